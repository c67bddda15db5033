"""Rank 0's progress lines and JSON-lines log; ``persia-launcher plot`` writes a PNG."""

from __future__ import annotations

import io
import json

import pytest

from persia_py.launcher.cli import main
from persia_py.launcher.plot import read_training_log
from persia_py.telemetry.progress import StepReporter


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _steps(reporter: StepReporter, n: int) -> None:
    for i in range(n):
        reporter.forward_started()
        reporter.forward_done()
        reporter.backward_done(started=0.0, batch_size=64, loss=1.0 / (i + 1), staleness=i % 3)


def test_plain_lines_every_n_steps_and_a_json_lines_log(tmp_path) -> None:
    out, log = io.StringIO(), tmp_path / "log" / "train_log.jsonl"
    reporter = StepReporter(rank=0, train_log=str(log), log_every=10, out=out)
    _steps(reporter, 25)
    reporter.log(test_auc=0.75)
    reporter.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 10", "step 20", "step 25: test_auc 0.75",
                                                       "step 25"]
    assert "| 640 samples |" in lines[0] and "samples/s | loss 0.1000 | staleness 0" in lines[0]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [*range(1, 26), 25]
    assert records[0]["loss"] == 1.0 and records[24]["samples"] == 25 * 64
    assert records[-1]["test_auc"] == 0.75 and "loss" not in records[-1]
    assert reporter.metrics.samples_per_second._value.get() > 0


def test_a_terminal_gets_one_line_redrawn_in_place() -> None:
    out = _Tty()
    reporter = StepReporter(rank=0, train_log=None, log_every=1, out=out)
    _steps(reporter, 50)
    reporter.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.count("\r") >= 2 and "step 50 |" in text


def test_other_ranks_print_and_write_nothing(tmp_path) -> None:
    out = io.StringIO()
    reporter = StepReporter(rank=1, train_log=str(tmp_path / "log.jsonl"), log_every=1, out=out)
    _steps(reporter, 5)
    reporter.close()
    assert out.getvalue() == "" and not (tmp_path / "log.jsonl").exists()


@pytest.mark.processes
def test_plot_writes_a_png(tmp_path) -> None:
    log = tmp_path / "train_log.jsonl"
    reporter = StepReporter(rank=0, train_log=str(log), out=io.StringIO())
    _steps(reporter, 200)
    reporter.log(test_auc=0.7)
    reporter.close()
    # The job restarted (the launcher's event has no step) and resumed from step 150.
    with open(log, "a") as f:
        f.write('{"event": "restart", "role": "nn-worker", "reason": "code 1", "time": 0}\n')
    reporter = StepReporter(rank=0, train_log=str(log), out=io.StringIO())
    reporter.resumed(step=150, samples=150 * 64, checkpoint="ckpt/ckpt-000000000150-0")
    _steps(reporter, 100)
    reporter.log(test_auc=0.8)
    reporter.close()
    records = read_training_log(log)
    resumed = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    assert records[resumed]["step"] == 150 and records[resumed + 1]["step"] == 151
    assert records[resumed + 1]["samples"] == 151 * 64
    png = tmp_path / "curves.png"
    assert main(["plot", str(log), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
