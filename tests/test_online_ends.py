"""Every way an online job ends by itself leaves a final checkpoint that the same command
goes on from exactly, checked by sample id (the ranks write the ids they trained): its
loader ends the stream, the stream's ``idle_timeout_sec``, a loader without a stream
reaching its natural end (see tests/online_job/data_loader.py). One job ended four times
serves every test: the training log's steps, samples and progressive-validation windows
go on across its resumes. (SIGTERM: tests/test_online_training.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
from online_jobs import (
    add_file,
    check_log_goes_on,
    checkpoint_steps,
    run_to_its_end,
    write_config,
)

from persia_py.launcher.plot import read_training_log

ENDS_EVERY = 4
"""Periodic checkpoints and progressive validation of the jobs below, in steps."""


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict:
    """One job ended four times by itself, each run going on from the last: runs 1 and 2
    (one rank; the same command) follow the stream, whose loader ends it after 6 batches
    or after 1 s without data: run 1 trains 6 of the 9 batches there and ends the stream,
    run 2 the 3 left, then its stream ends idle. Runs 3 and 4 (two ranks; the same command
    again) have a loader without a stream that reads the files there once and ends: run 3
    trains the 6 batches that arrived meanwhile, run 4 the 3 after it."""
    work = tmp_path_factory.mktemp("ended")
    (work / "stream").mkdir()
    write_config(work, every_steps=ENDS_EVERY)
    runs: dict = {"work": work, "checkpoints": []}
    files = iter(range(6))
    for run, num_files, loader_args, num_ranks in (
            ("run1", 3, "--end-after-batches 6 --idle-timeout-sec 1", 1),
            ("run2", 0, "--end-after-batches 6 --idle-timeout-sec 1", 1),
            ("run3", 2, "--finite", 2), ("run4", 1, "--finite", 2)):
        for _ in range(num_files):
            add_file(work / "stream", next(files))
        runs[run] = run_to_its_end(work, run, loader_args, num_ranks)
        runs["checkpoints"].append(checkpoint_steps(work))
    return runs


def _ended_with_checkpoint(out: str, batches: int) -> None:
    assert re.search(r"training ended \(the end of the stream\) at step \d+; final checkpoint "
                     rf".*ckpt-{batches:012d}-", out), out[-5000:]


@pytest.mark.processes
def test_a_stream_its_loader_ends_leaves_a_checkpoint_to_go_on_from(ended) -> None:
    (out, first), (out2, second) = ended["run1"], ended["run2"]
    np.testing.assert_array_equal(np.sort(first), np.arange(192))  # 6 of the 9 batches there
    np.testing.assert_array_equal(np.sort(second), np.arange(192, 288))  # none twice
    assert "data loader 0 sent 6 batches" in out, out[-5000:]
    _ended_with_checkpoint(out, 6)
    assert re.search(r"resuming from .*ckpt-000000000006-", out2), out2[-5000:]
    # The periodic checkpoint (step 4) is kept beside the final one.
    assert ended["checkpoints"][0] == [(4, 4), (6, 6)]


@pytest.mark.processes
def test_an_idle_stream_ends_with_a_checkpoint_to_go_on_from(ended) -> None:
    (out, _), (out3, third) = ended["run2"], ended["run3"]
    np.testing.assert_array_equal(np.sort(third), np.arange(288, 480))  # none twice
    assert "data loader 0 sent 3 batches" in out, out[-5000:]  # then 1 s without data
    _ended_with_checkpoint(out, 9)
    assert re.search(r"resuming from .*ckpt-000000000009-", out3), out3[-5000:]


@pytest.mark.processes
def test_a_loader_that_ends_leaves_a_checkpoint_to_go_on_from(ended) -> None:
    (out, _), (out4, fourth) = ended["run3"], ended["run4"]
    np.testing.assert_array_equal(np.sort(fourth), np.arange(480, 576))  # none twice
    # Two ranks: the first out of batches joins the other's steps.
    assert "data loader 0 sent 6 batches (9 skipped" in out, out[-5000:]
    _ended_with_checkpoint(out, 15)
    assert "data loader 0 sent 3 batches (15 skipped" in out4, out4[-5000:]


@pytest.mark.processes
def test_the_training_log_goes_on_across_resumes(ended) -> None:
    records = read_training_log(ended["work"] / "run" / "train_log.jsonl")
    # The job's step each run ended at (and the next resumed at): its final checkpoint's.
    *resumed_at, last = [max(j for _, j in kept) for kept in ended["checkpoints"]]
    assert resumed_at[:2] == [6, 9], resumed_at
    check_log_goes_on(records, resumed_at, ENDS_EVERY, last)
    steps = [r for r in records if "loss" in r]
    assert [r["samples"] for r in steps[:9]] == list(range(32, 289, 32))  # one rank
    assert sum(r["pv_samples"] for r in records if "pv_auc" in r) == 576  # each sample once
