"""The package type-checks: mypy, configured in pyproject.toml (``[tool.mypy]``), finds
no error in persia_py. It runs in this process (``mypy.api``: the unit tests start no
process). Its cache (``.mypy_cache``, ignored by git) makes later runs fast; the first
one in a checkout also reads the stubs of torch and numpy, and takes far longer."""

from __future__ import annotations

import gc
import re
import sys

import pytest
from conftest import ROOT
from mypy import api as mypy_api


def _checked_files() -> int:
    """What ``[tool.mypy]`` covers: every module of persia_py, the generated protobuf
    modules through their ``.pyi`` stubs instead."""
    package = ROOT / "persia_py"
    modules = [p for p in package.rglob("*.py") if not re.search(r"_pb2(_grpc)?\.py$", p.name)]
    return len(modules) + len(list(package.rglob("*_pb2.pyi")))


def test_package_type_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # where mypy reads pyproject.toml and keeps its cache
    # mypy tunes these for its own run; the tests after this one get them back.
    gc_thresholds, recursion_limit = gc.get_threshold(), sys.getrecursionlimit()
    try:
        stdout, stderr, status = mypy_api.run([])
    finally:
        gc.set_threshold(*gc_thresholds)
        sys.setrecursionlimit(recursion_limit)
    output = stdout + stderr
    assert status == 0, output
    # The whole package was checked, not a part the configuration happened to name.
    assert f"no issues found in {_checked_files()} source files" in output, output
