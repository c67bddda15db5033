"""benchmarks.ps_load runs end to end (briefly) and writes the figures it promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.processes


def test_ps_load_smoke(tmp_path) -> None:
    out = tmp_path / "ps_load.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ps_load", "--clients", "1,2", "--seconds", "0.5",
         "--capacity", "2000", "--id-space", "100000", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["peak_rss_bytes"] > 0
    assert result["rows_bounded_by_capacity"]
    assert [r["clients"] for r in result["runs"]] == [1, 2]
    assert all(r["ops"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in result["runs"])
    assert result["runs"][-1]["evicted"] > 0
