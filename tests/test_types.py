"""The package type-checks: mypy, configured in pyproject.toml (``[tool.mypy]``), finds
no error in persia_py. It runs in its own process, started by conftest as soon as the
tests are chosen so that it overlaps them (a first run in a checkout reads the stubs of
torch and numpy: too long for the unit set; its cache, ``.mypy_cache``, ignored by git,
makes later runs fast)."""

from __future__ import annotations

import re

import pytest
from checkout import PACKAGE_DIRS, ROOT


def _checked_files() -> int:
    """What ``[tool.mypy]`` covers: every module of persia_py, the generated protobuf
    modules through their ``.pyi`` stubs instead."""
    folders = [ROOT / "persia_py", *PACKAGE_DIRS.values()]
    modules = [p for folder in folders for p in folder.rglob("*.py")
               if not re.search(r"_pb2(_grpc)?\.py$", p.name)]
    return len(modules) + len(list((ROOT / "persia_py").rglob("*_pb2.pyi")))


@pytest.mark.processes
def test_package_type_checks(type_check: str) -> None:
    # conftest.type_check: mypy started as soon as the tests were chosen, checked here.
    # The whole package was checked, not a part the configuration happened to name.
    assert f"no issues found in {_checked_files()} source files" in type_check, type_check
