"""Layering of the package, checked on the source: ``workers/`` and ``servers/`` never
import each other, and no import cycle runs through ``persia_py`` modules.

The graph is built from the AST of every file, so it sees what import order would
hide: imports inside functions (lazy imports) and under ``if TYPE_CHECKING:`` count
like module-level ones (a typing-only import that closes a cycle still ties the
modules together)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"persia_py": ROOT / "persia_py", "persia_py.servers": ROOT / "servers",
           "persia_py.workers": ROOT / "workers"}
"""Import name of each source folder (setup.cfg ``package_dir``)."""


def _modules() -> dict[str, Path]:
    """Every module of the package by import name, from the files on disk."""
    found = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(imported: str) -> set[str]:
    """The package modules that importing ``imported`` runs: it and its packages."""
    parts = imported.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()


def imports_of(name: str) -> set[str]:
    """Package modules ``name`` imports anywhere in its file (not itself or its packages,
    which are running already when its code runs)."""
    path = MODULES[name]
    return imports_in(name, _package_of(name, path), path.read_text())


def imports_in(name: str, package: str, source: str, *, typing_only: bool = True) -> set[str]:
    """Package modules that the code ``source`` of module ``name`` (in ``package``)
    imports: at module level, in functions, relative, and (unless ``typing_only`` is
    False) under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source, name)
    skipped = set() if typing_only else _typing_only_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= _targets(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found |= _targets(module)
            for alias in node.names:  # ``from package import submodule``
                found |= _targets(f"{module}.{alias.name}")
    return found - _targets(name)


def _typing_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


GRAPH = {name: imports_of(name) for name in MODULES}
RUNTIME_GRAPH = {name: imports_in(name, _package_of(name, path), path.read_text(),
                                  typing_only=False) - _targets(name)
                 for name, path in MODULES.items()}
"""Imports that run (lazy ones included), without the typing-only ones."""


def _reachable(start: set[str], graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module reachable from ``start`` -> the module that imports it on the way."""
    via: dict[str, str] = {}
    todo = sorted(start)
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in via and nxt not in start:
                via[nxt] = node
                todo.append(nxt)
    return via


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("importer", "forbidden"), [("persia_py.workers", "persia_py.servers"),
                                                     ("persia_py.servers", "persia_py.workers")])
def test_workers_and_servers_do_not_import_each_other(importer: str, forbidden: str) -> None:
    offending = {name: sorted(t for t in targets if _in(t, forbidden))
                 for name, targets in GRAPH.items() if _in(name, importer)}
    offending = {name: targets for name, targets in offending.items() if targets}
    assert not offending, (f"{importer} must not import {forbidden} (shared code belongs in "
                           f"persia_py/): {offending}")


@pytest.mark.parametrize(("importer", "forbidden"), [("persia_py.workers", "persia_py.servers"),
                                                     ("persia_py.servers", "persia_py.workers")])
def test_nor_through_shared_modules(importer: str, forbidden: str) -> None:
    """What workers (servers) run, lazy imports included, never reaches servers
    (workers) through a persia_py module either; typing-only imports may."""
    start = {n for n in MODULES if _in(n, importer)}
    via = _reachable(start, RUNTIME_GRAPH)
    paths = {}
    for module in sorted(m for m in via if _in(m, forbidden)):
        path = [module]
        while path[-1] in via:
            path.append(via[path[-1]])
        paths[module] = " <- ".join(path)
    assert not paths, paths


def _loaded_after_importing(names: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of ``prefixes`` that a fresh interpreter holds after
    importing ``names`` (each must import)."""
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.processes
def test_importing_every_worker_module_loads_no_server_module() -> None:
    """Importing each ``persia_py.workers`` module (in a fresh interpreter) works and
    loads no ``persia_py.servers`` module, not even through a ``persia_py`` module."""
    workers = sorted(n for n in MODULES if _in(n, "persia_py.workers"))
    assert len(workers) > 3
    assert _loaded_after_importing(workers, ("persia_py.servers",)) == []


NO_TORCH = ["persia_py.ctx", "persia_py.embedding.data", "persia_py.env",
            "persia_py.servers.parameter_server", "persia_py.workers.embedding_worker",
            "persia_py.launcher.cli"]
"""What a data loader script (``from persia_py.ctx import DataCtx``), a parameter server,
an embedding worker and the launcher import: torch is a second of CPU and hundreds of MB
at each start of a role that never uses it."""


@pytest.mark.processes
def test_roles_without_a_dense_model_load_no_torch() -> None:
    # The NN contexts are reached lazily (PEP 562): DataCtx must not pull them in.
    assert _loaded_after_importing([*NO_TORCH, "persia_py.workers.data_loader"],
                                   ("torch",)) == []


@pytest.mark.processes
def test_a_rank_loads_torch_distributed_checkpoint_only_for_a_sharded_model() -> None:
    """``torch.distributed.checkpoint`` (with DTensor and sympy) costs each rank's start
    about a second of CPU; only FSDP jobs and sharded checkpoints use it."""
    rank = ["persia_py.ctx.train_ctx", "persia_py.ctx.infer_ctx", "persia_py.data",
            "persia_py.serving", "persia_py.checkpoint.coordinator"]
    assert _loaded_after_importing(rank, ("torch.distributed.checkpoint", "sympy")) == []


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycle_among_package_modules() -> None:
    assert import_cycles(GRAPH) == []


@pytest.mark.parametrize("source", [
    "def f():\n    from persia_py.ctx import current_ctx\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from persia_py.ctx import TrainCtx\n",
    "def f():\n    import persia_py.ctx\n",
    "from . import ctx\n",
    "from .ctx import TrainCtx\n",
])
def test_the_checks_see_lazy_typing_and_relative_imports(source: str) -> None:
    """The detector itself: an import of persia_py.ctx by persia_py.data written in any
    of these ways is an edge, and it closes the cycle back through ctx's imports."""
    assert "persia_py.ctx" in imports_in("persia_py.data", "persia_py", source)
    graph = dict(GRAPH)
    graph["persia_py.data"] = GRAPH["persia_py.data"] | imports_in("persia_py.data",
                                                                 "persia_py", source)
    graph["persia_py.ctx"] = GRAPH["persia_py.ctx"] | {"persia_py.data"}
    assert any({"persia_py.ctx", "persia_py.data"} <= set(c) for c in import_cycles(graph))


def test_cycle_detector() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # The graph maps folders to import names and resolves ``from pkg import module``.
    assert "persia_py.workers.budget" in GRAPH["persia_py.workers.nn_worker"]
    assert "persia_py.wire.codec" in GRAPH["persia_py.workers.nn_worker"]
    assert "persia_py.servers.parameter_server" in GRAPH["persia_py.servers.service"]


LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("persia_py.proto", "persia_py.config", "persia_py.ids", "persia_py.ops",
                     "persia_py.env")),
    ("services", ("persia_py.wire", "persia_py.input", "persia_py.dense",
                  "persia_py.embedding", "persia_py.telemetry", "persia_py.checkpoint")),
    ("roles", ("persia_py.servers", "persia_py.workers")),
    ("api", ("persia_py", "persia_py.ctx", "persia_py.data", "persia_py.distributed",
             "persia_py.metrics", "persia_py.utils", "persia_py.logger", "persia_py.serving",
             "persia_py.progressive", "persia_py.stream_source", "persia_py.data_readers",
             "persia_py.stream_reader", "persia_py.reader_share")),
    ("launcher", ("persia_py.launcher",)),
]
"""The layers, lowest first: a module imports only from its own layer and those below
(typing-only imports included). docs/architecture.md draws the same table."""


def unit_of(name: str) -> str:
    """The package (or top-level module) of the layer table that holds module ``name``."""
    units = [u for _, members in LAYERS for u in members if _in(name, u) and u != "persia_py"]
    if not units:
        return "persia_py" if name == "persia_py" else ""
    return max(units, key=len)


RANK = {unit: rank for rank, (_, members) in enumerate(LAYERS) for unit in members}


def test_every_module_has_a_layer() -> None:
    """A new module lands in a package of the table, or the table says where it sits."""
    unplaced = sorted(name for name in MODULES if not unit_of(name))
    assert not unplaced, f"add these to LAYERS (tests/test_layering.py): {unplaced}"


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = []
    for name, targets in sorted(GRAPH.items()):
        for target in sorted(targets):
            if RANK[unit_of(target)] > RANK[unit_of(name)]:
                wrong.append(f"{name} ({LAYERS[RANK[unit_of(name)]][0]}) imports {target} "
                             f"({LAYERS[RANK[unit_of(target)]][0]})")
    assert not wrong, "\n".join(wrong)


def test_no_cycle_between_packages() -> None:
    """Packages of one layer may use each other one way only."""
    graph: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        graph.setdefault(unit_of(name), set()).update(
            unit_of(t) for t in targets if unit_of(t) != unit_of(name))
    assert import_cycles(graph) == []


def test_the_architecture_page_draws_these_layers() -> None:
    """docs/architecture.md's layer table lists the same packages, layer by layer."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page.split("| layer | packages and modules |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[1:]]
    drawn = [(layer.strip(), tuple(re.findall(r"`([\w.]+)`", cell))) for layer, cell in rows]
    assert drawn == LAYERS
