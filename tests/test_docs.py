"""The docs stay true: CLI reference current, every config key in docs/configuration.md, the Grafana
dashboard only charts metrics that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
import typing

from checkout import ROOT

from persia_py.config import EmbeddingTablesConfig, GlobalConfig


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key path of a config dataclass; mapping entries appear as ``<slot>``."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:  # derived in __post_init__, not a key
            continue
        tp, path = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            keys += _keys(tp, f"{path}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            keys += _keys(typing.get_args(tp)[1], f"{path}.<slot>.")
        else:
            keys.append(path)
    return keys


def test_configuration_reference_documents_every_config_key() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    keys = _keys(GlobalConfig) + _keys(EmbeddingTablesConfig)
    missing = [k for k in keys if f"`{k}`" not in reference]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_cli_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text() == module.cli_reference(), (
        "docs/cli.md is stale; run: .venv/bin/python scripts/gen_cli_docs.py")


def test_grafana_dashboard_charts_existing_metrics() -> None:
    dashboard = json.loads((ROOT / "monitoring" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = {name for source in ("persia_py/telemetry/monitoring.py", "servers/metrics.py",
                                 "workers/metrics.py")
             for name in re.findall(r"persia_\w+", (ROOT / source).read_text())}
    used = {re.sub(r"_(total|bucket|count|sum)$", "", n) for e in exprs
            for n in re.findall(r"persia_\w+", e)}
    assert used and used <= names, used - names
    roles = {"persia_ps", "persia_embedding_worker", "persia_nn_worker", "persia_data_loader"}
    assert all(any(n.startswith(r) for n in used) for r in roles)


_MEASURED = re.compile(
    r"\b\d[\d,.]*\s?(samples/s|ids/s|rows/s|MB/s|GB/s)"  # throughput
    r"|\b\d+(\.\d+)?x\b"                                  # a ratio to a baseline
    r"|\b\d+(\.\d+)?\s?%"                                 # a share or a rate
    r"|\bAUC\b[^.]*\b0\.\d{2,}")                          # an accuracy


def _manual_pages() -> list:
    """The README and every docs page but the benchmarks page itself."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md")
                                         if p.name not in ("benchmarks.md", "cli.md"))


def test_every_measured_figure_in_the_manual_links_to_the_benchmarks_page() -> None:
    """The README and docs pages are the manual; figures live in docs/benchmarks.md with
    their command, date and machine, and a paragraph that quotes one links there."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", page, flags=re.M)}
    for path in _manual_pages():
        raw = path.read_text()
        text = re.sub(r"```.*?```", "", raw, flags=re.S)
        text = re.sub(r"`[^`]*`", "", text)  # example output and settings, not measurements
        unlinked = [p for p in re.split(r"\n\s*\n|\n(?=- )", text)
                    if _MEASURED.search(p) and "benchmarks.md" not in p]
        assert not unlinked, (f"{path.name}: figures without a link to docs/benchmarks.md:\n"
                              + "\n--\n".join(unlinked))
        for anchor in set(re.findall(r"benchmarks\.md#([\w-]+)", raw)):
            assert anchor in headings, f"{path.name} links benchmarks.md#{anchor}, which has no such heading"


def test_links_between_pages_resolve() -> None:
    """Every relative link of the manual names a file that exists and, with an anchor, a
    heading of that file."""
    for path in _manual_pages():
        for target, anchor in re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([\w-]+))?\)", path.read_text()):
            dest = (path.parent / target).resolve() if target else path
            assert dest.exists(), f"{path.name} links {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                            for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
                assert anchor in headings, f"{path.name} links {target}#{anchor}: no such heading"


NUMPY_OF_A_TENSOR = re.compile(r"(?<!\.cpu\(\))\.numpy\(\)")
"""``.numpy()`` not straight after ``.cpu()``: on a GPU, ``ctx.forward``'s outputs and
labels live in device memory and ``tensor.numpy()`` raises there (while passing on a CPU)."""


def test_examples_and_doc_code_move_tensors_to_the_cpu_before_numpy() -> None:
    """Code a user copies runs on a GPU too: every ``.numpy()`` in examples/ and in the
    docs' code blocks follows ``.cpu()``."""
    sources = [(p, p.read_text()) for p in sorted((ROOT / "examples").rglob("*.py"))]
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), flags=re.M | re.S)
        sources.append((page, "\n".join(blocks)))
    for path, text in sources:
        for line in text.splitlines():
            assert not NUMPY_OF_A_TENSOR.search(line), (
                f"{path.relative_to(ROOT)}: {line.strip()!r}: call .cpu() before .numpy()")


def test_the_api_page_lists_every_embedding_optimizer_with_its_arguments_and_defaults() -> None:
    """docs/api.md's table of embedding optimizers holds each class
    ``persia_py.embedding.optim`` exports, each of its arguments in order, and each
    default as Python writes it (``(required)`` where there is none)."""
    from persia_py.embedding import optim

    section = (ROOT / "docs" / "api.md").read_text().split("## Embedding optimizers", 1)[1]
    listed: dict[str, list[tuple[str, str]]] = {}
    owner = ""
    for cls, arg, default in re.findall(r"^\| (?:`(\w+)`)? *\| `(\w+)` \| ([^|]+?) \|",
                                        section.split("\n## ", 1)[0], flags=re.M):
        owner = cls or owner
        listed.setdefault(owner, []).append((arg, default))
    expected = {}
    for name in optim.__all__:
        cls = getattr(optim, name)
        if cls is optim.Optimizer:
            continue
        expected[name] = [(p.name, "(required)" if p.default is p.empty else f"`{p.default!r}`")
                          for p in inspect.signature(cls).parameters.values()]
    assert listed == expected
