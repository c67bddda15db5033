"""The size rules of the package, checked on the source: a module at most
``MAX_MODULE_LINES`` lines, a function (or method) at most ``MAX_FUNCTION_LINES`` from
its ``def`` to its last line, decorators apart. The module rule holds for the tests'
own modules too (``TESTS``). Each exception is listed below with its reason; one the
code no longer needs must leave the list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from checkout import ROOT

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
SOURCES = (ROOT / "persia_py", ROOT / "servers", ROOT / "workers")
"""The package's folders (setup.cfg ``package_dir`` maps servers/ and workers/ into it)."""
TESTS = ROOT / "tests"
"""The test modules and their helpers (conftest.py, child_processes.py, ...): the module
rule only; four tests are longer than ``MAX_FUNCTION_LINES`` today."""

LONG_FUNCTIONS: dict[str, str] = {
    "servers/kernels.py::adaptive_step":
        "numba kernel: Adagrad and Adam in one loop; helpers taking the arrays, called per "
        "row, cost 10-15 % of the step (docs/benchmarks.md, 'Parameter server')",
}
"""``path::function`` -> why it may pass ``MAX_FUNCTION_LINES``."""
LONG_MODULES: dict[str, str] = {}
"""Module path -> why it may pass ``MAX_MODULE_LINES``."""


def _modules(folders: tuple[Path, ...] = SOURCES) -> list[Path]:
    """Every module in ``folders`` (the package's by default) but protoc's generated ones."""
    return sorted(p for folder in folders for p in folder.rglob("*.py")
                  if not re.search(r"_pb2(_grpc)?\.py$", p.name))


def module_sizes() -> dict[str, int]:
    """Lines of every module of the package and of the tests."""
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for p in _modules((*SOURCES, TESTS))}


def function_sizes(source: str, path: str) -> dict[str, int]:
    """``path::name`` -> lines from ``def`` to the function's last line, for every
    function and method in ``source`` (nested ones too; the longest of a repeated name)."""
    sizes: dict[str, int] = {}
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            key = f"{path}::{node.name}"
            sizes[key] = max(sizes.get(key, 0), (node.end_lineno or node.lineno) - node.lineno + 1)
    return sizes


def test_the_function_measure() -> None:
    source = ("@deco\ndef f():\n    def g():\n        pass\n    return g\n\n\n"
              "class C:\n    def m(self):\n        return 1\n")
    assert function_sizes(source, "x.py") == {"x.py::f": 4, "x.py::g": 2, "x.py::m": 2}


def test_modules_are_at_most_500_lines() -> None:
    sizes = module_sizes()
    too_long = {path: n for path, n in sizes.items()
                if n > MAX_MODULE_LINES and path not in LONG_MODULES}
    assert not too_long, f"split these modules (or list them with a reason): {too_long}"
    fitting = [path for path in LONG_MODULES if sizes.get(path, 0) <= MAX_MODULE_LINES]
    assert not fitting, f"these fit the rule now: remove them from LONG_MODULES: {fitting}"


def test_functions_are_at_most_80_lines() -> None:
    sizes: dict[str, int] = {}
    for path in _modules():
        sizes.update(function_sizes(path.read_text(), str(path.relative_to(ROOT))))
    too_long = {key: n for key, n in sizes.items()
                if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS}
    assert not too_long, f"split these functions (or list them with a reason): {too_long}"
    fitting = [key for key in LONG_FUNCTIONS if sizes.get(key, 0) <= MAX_FUNCTION_LINES]
    assert not fitting, f"these fit the rule now: remove them from LONG_FUNCTIONS: {fitting}"
