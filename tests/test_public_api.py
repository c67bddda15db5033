"""Every import path our docs and examples use imports, and the top level is the public
API: each public module says what it exports (``__all__``), and each exported name exists.

The names are read from the files themselves (README.md, docs/*.md, examples/**/*.py):
``from persia_py... import a, b`` statements and dotted references such as
``persia_py.ids.hash_values``, so a module moved without its documented path failing
here cannot happen."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.test_layering import LAYERS, MODULES

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").rglob("*.py"))]
_FROM_IMPORT = re.compile(r"^\s*from (persia_py[\w.]*) import \(?([\w, \n]+?)\)?\s*$", re.M)
_IMPORT = re.compile(r"^\s*import (persia_py[\w.]*)(?: as \w+)?\s*$", re.M)
_DOTTED = re.compile(r"(?<![\w./-])persia_py(?:\.[A-Za-z_]\w*)+")


def documented_names() -> dict[str, set[str]]:
    """``module:name`` (or a dotted path) -> the files that use it."""
    found: dict[str, set[str]] = {}
    for path in DOCUMENTS:
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for module, names in _FROM_IMPORT.findall(text):
            for name in names.replace("\n", " ").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    found.setdefault(f"{module}:{name}", set()).add(where)
        for module in _IMPORT.findall(text):
            found.setdefault(module, set()).add(where)
        for dotted in _DOTTED.findall(text):
            found.setdefault(dotted.rstrip("."), set()).add(where)
    return found


DOCUMENTED = documented_names()


def resolve(path: str) -> object:
    """The object a documented path names: ``module:name`` or ``package.module.attr...``."""
    if ":" in path:
        module, name = path.split(":")
        owner = importlib.import_module(module)
        return getattr(owner, name) if hasattr(owner, name) else importlib.import_module(
            f"{module}.{name}")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_the_documents_name_many_paths() -> None:
    assert len(DOCUMENTED) > 60, sorted(DOCUMENTED)


@pytest.mark.parametrize("path", sorted(DOCUMENTED))
def test_every_documented_path_imports(path: str) -> None:
    try:
        resolve(path)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{path} (used in {', '.join(sorted(DOCUMENTED[path]))}) does not "
                    f"import: {e}")


PUBLIC = sorted(name for name in MODULES
                if any(name == unit and unit != "persia_py.launcher"
                       for _, units in LAYERS[-2:] for unit in units)
                or name in ("persia_py.config", "persia_py.ids", "persia_py.env",
                            "persia_py.embedding", "persia_py.embedding.data",
                            "persia_py.embedding.optim"))
"""The public modules: the top level of the package (and ``embedding``'s data types)."""


def test_the_top_level_holds_only_public_modules() -> None:
    top = {name for name in MODULES if name.count(".") == 1}
    internal = {name for _, units in LAYERS for name in units if name.count(".") == 1
                and name not in PUBLIC}
    assert top - set(PUBLIC) <= internal, sorted(top - set(PUBLIC) - internal)
    assert internal <= {f"persia_py.{p}" for p in ("proto", "ops", "wire", "input", "dense",
                                                   "checkpoint", "telemetry", "servers",
                                                   "workers", "launcher")}


@pytest.mark.parametrize("module", PUBLIC)
def test_public_module_exports_what_exists(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    declared = [node for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert declared, f"{module} has no __all__"
    loaded = importlib.import_module(module)
    missing = [name for name in loaded.__all__ if not hasattr(loaded, name)]
    assert not missing, missing


def test_the_manual_says_where_each_public_name_it_uses_is_imported_from() -> None:
    """A name a public module exports, written in code in a README or docs paragraph (e.g.
    ``share=ReaderShare(i, n)``), has its module named in some paragraph of the manual
    beside it: ``from M import N``, ``M.N``, or ``M`` and ``N`` in one paragraph. A user
    who reads of a class must find where to import it from without guessing.
    (docs/architecture.md names packages by their short names, for developers.)"""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                         if p.name not in ("architecture.md", "benchmarks.md",
                                                           "cli.md"))]
    paragraphs = [p for page in pages
                  for p in re.split(r"\n\s*\n|\n(?=- )", page.read_text())]
    homes: dict[str, set[str]] = {}
    for module in PUBLIC:
        for name in importlib.import_module(module).__all__:
            homes.setdefault(name, set()).add(module)
    unsaid = []
    for name, modules in sorted(homes.items()):
        word = re.compile(rf"(?<![\w.]){re.escape(name)}\b")
        if not any(word.search(code) for p in paragraphs for code in re.findall(r"`([^`]+)`", p)):
            continue
        if not any(f"{m}.{name}" in p or (re.search(rf"\b{re.escape(m)}\b(?!\.\w)", p)
                                          and word.search(p))
                   for p in paragraphs for m in modules):
            unsaid.append(f"{name} (from {' or '.join(sorted(modules))})")
    assert not unsaid, f"the manual uses these names without their module: {unsaid}"
