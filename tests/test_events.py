"""Job events reach the launcher's summary as records, from real processes appending to
one training log at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from persia_py.launcher.recovery import BatchCounts
from persia_py.telemetry.events import ENV_TRAIN_LOG, Event, emit, read_events


def test_the_summary_counts_events_not_words(tmp_path, monkeypatch) -> None:
    log = tmp_path / "train.jsonl"
    monkeypatch.setenv(ENV_TRAIN_LOG, str(log))
    with open(log, "w") as f:  # rank 0's step records share the file
        f.write(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    emit(Event.LOADER_FINISHED, loader=0, sent=7, skipped=1, resent=0)
    emit(Event.LOADER_FINISHED, loader=1, sent=5, skipped=0, resent=1)
    emit(Event.LOADER_FINISHED, loader=0, sent=9, skipped=2, resent=0)  # its restart's run
    emit(Event.BATCH_RESENT, batch=3, embedding_worker=0)
    emit(Event.TRAINING_REWOUND, restart=1, checkpoint="c")
    assert BatchCounts(log).summary() == (
        "batches: 14 sent by the data loaders' last runs (2 skipped: trained before the "
        "checkpoint they resumed, or handed over before they restarted), 1 re-sent to "
        "restarted embedding workers; torchrun restarts of the NN ranks: 1 (each went back "
        "to its checkpoint)")


def test_no_log_no_event_and_no_summary(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_TRAIN_LOG, raising=False)
    emit(Event.BATCH_RESENT, batch=1, embedding_worker=0)  # a role started by hand
    assert BatchCounts(tmp_path / "none.jsonl").summary() is None
    assert list(tmp_path.iterdir()) == []


def test_a_torn_line_is_skipped_and_said(tmp_path, caplog) -> None:
    log = tmp_path / "train.jsonl"
    emit(Event.BATCH_RESENT, to=log, batch=1, embedding_worker=0)
    with open(log, "a") as f:
        f.write('{"event": "batch_res')
    assert [r["batch"] for r in read_events(log)] == [1]
    assert "line 2: not a JSON record" in caplog.text


@pytest.mark.processes
def test_processes_appending_at_once_lose_no_record(tmp_path) -> None:
    log = tmp_path / "train.jsonl"
    code = ("import sys\nfrom persia_py.telemetry.events import emit\n"
            "for i in range(400):\n"
            "    emit('batch_resent', to=sys.argv[1], batch=i, pad='x' * 300,"
            " embedding_worker=int(sys.argv[2]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(log), str(w)])
             for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    records = list(read_events(log))
    assert len(records) == 1600
    for w in range(4):
        assert [r["batch"] for r in records if r["embedding_worker"] == w] == list(range(400))
