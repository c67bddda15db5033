"""The README's "Your first job" runs as written: its code blocks become the files they
name, its command is run from their folder, and the model they train beats chance
clearly. Any drift between the README and the package fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from checkout import ROOT
from child_processes import RoleProcess, launcher_command, processes_with_marker

SECTION = "## Your first job"
FILES = {"embedding_config.yml", "data_loader.py", "train.py"}


def first_job() -> tuple[dict[str, str], list[str]]:
    """The section's files (name from each block's first line, ``# <name>: ...``) and
    its one command, as argv (continuation lines joined, comments dropped)."""
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end != -1 else len(text)]
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        if lang == "bash":
            lines = body.replace("\\\n", " ").splitlines()
            commands += [line.strip() for line in lines
                         if line.strip() and not line.lstrip().startswith("#")]
            continue
        match = re.match(r"# ([\w.]+):", body)
        assert match, f"a {lang} block of {SECTION!r} names its file first:\n{body[:200]}"
        assert match.group(1) not in files, f"{match.group(1)} appears twice"
        files[match.group(1)] = body
    assert set(files) == FILES, sorted(files)
    assert len(commands) == 1, commands
    return files, shlex.split(commands[0])


def test_the_readme_is_a_landing_page() -> None:
    """At most 250 lines, the quick start first, and the pages a newcomer needs linked."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings.index("Quick start") < headings.index("Your first job")
    for page in ("docs/concepts.md", "docs/faq.md", "docs/sizing.md", "docs/configuration.md"):
        assert f"]({page}" in text, page


@pytest.mark.processes
def test_the_first_job_runs_as_written_and_learns(tmp_path: Path) -> None:
    files, argv = first_job()
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    assert argv[:2] == ["persia-launcher", "local"], argv
    job = RoleProcess(launcher_command(*argv[1:]), cwd=tmp_path)
    try:
        code = job.wait(timeout=300)
        output = job.output()
        assert code == 0, output
        aucs = [float(line.split("test_auc:")[1]) for line in job.lines if "test_auc:" in line]
        assert len(aucs) == 1, output
        assert aucs[0] > 0.7, output  # chance is 0.5
        assert processes_with_marker(job.marker) == [], output
    finally:
        job.stop()
