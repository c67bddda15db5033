"""The package type-checks: mypy, configured in pyproject.toml (``[tool.mypy]``), finds
no error in persia_py. It runs in its own process (a first run in a checkout reads the
stubs of torch and numpy and takes about half a minute, too long for the unit set; its
cache, ``.mypy_cache``, ignored by git, makes later runs fast)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT


def _checked_files() -> int:
    """What ``[tool.mypy]`` covers: every module of persia_py, the generated protobuf
    modules through their ``.pyi`` stubs instead."""
    package = ROOT / "persia_py"
    modules = [p for p in package.rglob("*.py") if not re.search(r"_pb2(_grpc)?\.py$", p.name)]
    return len(modules) + len(list(package.rglob("*_pb2.pyi")))


@pytest.mark.processes
def test_package_type_checks() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # The whole package was checked, not a part the configuration happened to name.
    assert f"no issues found in {_checked_files()} source files" in output, output
