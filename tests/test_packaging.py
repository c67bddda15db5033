"""The package as users get it: generated protos are current, and a built wheel installs
``persia_py.servers`` and ``persia_py.workers`` into a fresh environment."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from checkout import ROOT

pytestmark = pytest.mark.processes


def test_generated_protos_match_sources(tmp_path: Path) -> None:
    sources = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         *sources],
        check=True, cwd=ROOT / "proto",
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "persia_py" / "proto").glob("*_pb2*"))
    assert [str(p) for p in generated] == [str(p) for p in committed]
    for path in generated:
        assert filecmp.cmp(tmp_path / path, ROOT / path, shallow=False), (
            f"{path} is stale: run scripts/gen_protos.sh")


def test_wheel_installs_servers_and_workers_subpackages(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.egg-info", "build", "dist"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("persia_py-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    # The package imports nothing heavy at import time, so this needs none of its deps.
    # Without PYTHONPATH: a checkout named there (a git worktree's tests) would be found
    # before the installed wheel.
    out = subprocess.run(
        [python, "-c", "import persia_py.servers as s, persia_py.workers as w; "
                       "print(s.__file__); print(w.__file__)"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.split()
    assert all(str(env_dir) in path for path in out), out
    assert (env_dir / "bin" / "persia-launcher").exists()
    names = subprocess.run([python, "-m", "pip", "show", "-f", "persia_py"], check=True,
                           capture_output=True, text=True).stdout
    assert "persia_py/servers/storage.py" in names and "persia_py/workers/nn_worker.py" in names
    assert "servers/__init__.py" not in names.replace("persia_py/servers/__init__.py", "")


def test_code_is_ruff_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff is a test dependency (pip install -e '.[test]')"
    result = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout
