"""Online training: an endless stream in, stopped or ended, resumed exactly.

* A ``persia-launcher local`` job (2 NN ranks) follows a folder of CSV files while more
  arrive; SIGTERM stops it cleanly (exit 0, final checkpoint); started again (one rank)
  it goes on from the exact stream position, and SIGTERM stops it again while it waits
  for data: over both runs every sample id is trained exactly once (the ranks write the
  ids they trained to files). The parameter server writes a
  last increment as it stops; progressive validation reports land in both runs' logs,
  every sample in one of them, and the second run's steps go on from the first's.
  (Every other way a job ends: tests/test_online_ends.py.)
* A data loader waits out an embedding worker's outage with ``rpc_timeout_sec`` calls.
* The stream readers: a folder followed in name order, lines appended to a file (a
  partial last line waits for its newline), Parquet, reading a range again, the
  position log (torn last line, compaction), bad input named by file and row.
* Metrics: log loss, NE, GAUC and histogram AUC against references; across two gloo
  ranks (and progressive validation's reports) equal to one process's values.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from child_processes import RoleProcess, run_ranks
from online_jobs import ROWS_PER_FILE, add_file, start, trained_ids, write_config

from persia_py.input.readers import BadRecordError, CsvColumn, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, ParquetFormat, StreamPosition, StreamReader
from persia_py.launcher.plot import read_training_log
from persia_py.stream_source import PositionLog
from persia_py.workers.loader_service import MAX_LEAD

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
           CsvColumn(name="x", kind="float"), CsvColumn(name="user", kind="ids"),
           CsvColumn(name="item", kind="ids"))


def _wait_trained(job: RoleProcess, total: int, timeout: float = 120) -> None:
    """Until the ranks' running counts add up to ``total`` samples."""
    counts: dict[str, int] = {}
    while sum(counts.values()) < total:
        match = job.wait_for_line(r"rank (\d+) trained (\d+) samples", timeout=timeout)
        counts[match.group(1)] = int(match.group(2))


def _stop(job: RoleProcess) -> str:
    os.kill(job.process.pid, signal.SIGTERM)
    return job.finish(timeout=120)


@pytest.mark.processes
def test_sigterm_then_restart_trains_every_sample_exactly_once(tmp_path: Path) -> None:
    stream = tmp_path / "stream"
    stream.mkdir()
    write_config(tmp_path, every_steps=4)
    total = sum(add_file(stream, i) for i in range(3))
    job = start(tmp_path, "run1", num_ranks=2)
    try:
        _wait_trained(job, 64)
        total += sum(add_file(stream, i) for i in range(3, 11))  # files arrive as it trains
        _wait_trained(job, 384)  # both ranks past their first report (4 steps of 32)
    except BaseException:
        job.stop()
        raise
    out = _stop(job)
    assert re.search(r"SIGTERM: stopping after the current step", out), out[-5000:]
    assert re.search(r"final checkpoint .*ckpt-", out), out[-5000:]
    assert len(re.findall(r"rank \d stopped cleanly", out)) == 2, out[-5000:]
    # The hourly export never came due: the one there is the parameter server's last, as it
    # stopped, so serving gets the final rows too.
    assert [p.name[:9] for p in (tmp_path / "increments").glob("inc-*")] == ["inc-0000-"]
    first = trained_ids(tmp_path / "run1")
    assert 160 <= first.size < total  # stopped mid-stream, with files left to read

    total += sum(add_file(stream, i) for i in range(11, 13))  # arrived while it was stopped
    # Started again (with one rank: a checkpoint resumes on any number), it goes on from
    # there; with every sample trained it waits for data, and SIGTERM stops it there too.
    job = start(tmp_path, "run2", num_ranks=1)
    try:
        job.wait_for_line(r"resuming from .*ckpt-", timeout=60)
        _wait_trained(job, 32)
        total += add_file(stream, 13)
        _wait_trained(job, total - first.size)
    except BaseException:
        job.stop()
        raise
    out = _stop(job)
    assert re.search(r"final checkpoint .*ckpt-", out), out[-5000:]
    every = np.sort(np.concatenate([first, trained_ids(tmp_path / "run2")]))
    assert every.size == total, f"{every.size} samples trained, {total} in the stream"
    np.testing.assert_array_equal(every, np.arange(total))  # none skipped, none twice
    # Progressive validation: both runs logged AUC, log loss, NE and GAUC of all ranks'
    # pre-update scores, every 4 steps of the job and at SIGTERM: every sample trained
    # is in one report. The second run's log goes on from the step it resumed at.
    logs = [read_training_log(tmp_path / run / "train_log.jsonl") for run in ("run1", "run2")]
    reports = [r for log in logs for r in log if "pv_auc" in r]
    assert sum(r["pv_samples"] for r in reports) == total, reports
    assert all(0 < r["pv_logloss"] and 0 <= r["pv_auc"] <= 1 and 0 <= r["pv_gauc"] <= 1
               for r in reports), reports
    [resumed] = [r for r in logs[1] if r.get("event") == "resume"]
    first_step = next(r["step"] for r in logs[1] if "loss" in r)
    assert first_step == resumed["step"] + 1 and resumed["step"] >= 4, logs[1][:3]
    assert resumed["samples"] > 0 and resumed["checkpoint"] in out, resumed


@pytest.mark.processes
def test_a_rank_that_starts_late_still_gets_batches_of_the_first_burst(tmp_path: Path) -> None:
    """The stream starts with 9 batches, fewer than one rank's DataLoader holds, and rank 1
    asks for its first 2 s after rank 0 has been handed ``MAX_LEAD``: the loader hands rank
    0 no more beyond rank 1, so both train without more data arriving. (Unbounded, rank 0
    took all 9 and waited in its first step for rank 1, which waited for data.)"""
    stream = tmp_path / "stream"
    stream.mkdir()
    write_config(tmp_path, every_steps=4)
    for i in range(3):
        add_file(stream, i)
    job = start(tmp_path, "run1", num_ranks=2, nn_args=f"--rank1-after {MAX_LEAD}")
    try:
        _wait_trained(job, 2 * 2 * 32, timeout=60)  # two steps of both ranks
    except BaseException:
        job.stop()
        raise
    out = _stop(job)
    assert len(re.findall(r"rank \d stopped cleanly", out)) == 2, out[-5000:]
    assert trained_ids(tmp_path / "run1").size >= 128


# -- readers ------------------------------------------------------------------------------

def _reader(path: Path, **kwargs) -> StreamReader:
    config = CsvReaderConfig(columns=COLUMNS, header=kwargs.pop("header", False))
    return StreamReader(path, CsvFormat(config), poll_interval_sec=0.01,
                        max_wait_sec=kwargs.pop("max_wait_sec", 0.05),
                        idle_timeout_sec=kwargs.pop("idle_timeout_sec", 0.3), **kwargs)


def _sids(batches) -> list[int]:
    return [int(s) for b in batches for s in b.records.values["sid"]]


def test_folder_is_read_in_name_order_with_exact_positions(tmp_path: Path) -> None:
    for index in (1, 0, 2):
        add_file(tmp_path, index)
    (tmp_path / ".hidden.csv").write_text("not,a,record\n")
    reader = _reader(tmp_path, header=True, pattern="*.csv")
    batches = list(reader.batches(40))
    assert _sids(batches) == list(range(3 * ROWS_PER_FILE))
    assert [b.num_records for b in batches] == [40, 40, 16] * 3  # a batch never spans files
    assert batches[0].start == StreamPosition("000.csv", 0, 0)
    for before, batch in zip(batches, batches[1:]):  # contiguous: each starts where one ended
        same_file = batch.start.file == before.end.file
        assert batch.start == (before.end if same_file else StreamPosition(batch.start.file))
    third = batches[4]
    assert third.start.file == "001.csv" and third.records.rows[0] == third.start.row + 1
    again = reader.read(third.start, third.end)  # a range read again is the same records
    np.testing.assert_array_equal(again.records.values["sid"], third.records.values["sid"])
    np.testing.assert_array_equal(again.records.id_lists["user"][0],
                                  third.records.id_lists["user"][0])
    resumed = list(_reader(tmp_path, header=True, pattern="*.csv").batches(40, start=third.end))
    assert _sids(resumed) == list(range(third.records.values["sid"][-1] + 1, 3 * ROWS_PER_FILE))


def test_appended_lines_are_read_only_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "events.csv"
    path.write_text("0,1,0.5,3,4\n1,0,0.25,5,6\n2,1,0.1")  # the last line is not complete
    reader = _reader(path, idle_timeout_sec=5.0)
    batches = reader.batches(3)
    first = next(batches)  # a short batch after max_wait_sec, without the partial line
    assert first.records.values["sid"].tolist() == [0, 1]
    assert first.end.offset == len("0,1,0.5,3,4\n1,0,0.25,5,6\n")
    with open(path, "a") as f:
        f.write("25,7,8\n3,0,1.5,9,10\n4,1,2.5,11,12\n")  # completes line 3, and two more
    second = next(batches)
    assert second.records.values["sid"].tolist() == [2, 3, 4]
    np.testing.assert_allclose(second.records.values["x"], [0.125, 1.5, 2.5])  # "0.1"+"25"
    assert second.records.rows.tolist() == [3, 4, 5]
    reader.stop.set()
    assert list(batches) == []


def test_files_out_of_name_order_and_bad_rows_are_errors(tmp_path: Path) -> None:
    add_file(tmp_path, 1)
    reader = _reader(tmp_path, header=True, idle_timeout_sec=5.0)
    batches = reader.batches(ROWS_PER_FILE)
    assert next(batches).start.file == "001.csv"
    add_file(tmp_path, 0)  # named before the file being read: would be skipped silently
    with pytest.raises(RuntimeError, match="'000.csv' appeared after '001.csv'"):
        next(batches)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.csv").write_text("0,1,0.5,3,4\n1,0,oops,5,6\n")
    with pytest.raises(BadRecordError, match=r"a\.csv: row 2: column 'x': 'oops'"):
        list(_reader(bad).batches(10))
    (bad / "a.csv").write_text("0,1,0.5,3\n")
    with pytest.raises(BadRecordError, match=r"a\.csv: row 1: 4 fields, expected 5"):
        list(_reader(bad).batches(10))


def test_parquet_folder(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")  # in the test extra; the skip only names a bare install
    import pyarrow.parquet as pq

    for index in range(2):
        first = index * 10
        table = pa.table({
            "sid": pa.array(np.arange(first, first + 10), pa.int64()),
            "label": pa.array(np.arange(10) % 2, pa.float32()),
            "tags": pa.array([list(range(i % 3)) for i in range(10)], pa.list_(pa.int64())),
            "user": pa.array(np.arange(10) + 100, pa.int64()),
            "extra": pa.array(["z"] * 10),
        })
        pq.write_table(table, tmp_path / f"part-{index}.parquet")
    columns = (CsvColumn(name="sid", kind="int"), CsvColumn(name="label", kind="float"),
               CsvColumn(name="tags", kind="ids"), CsvColumn(name="user", kind="ids"))
    reader = StreamReader(tmp_path, ParquetFormat(columns), pattern="*.parquet",
                          poll_interval_sec=0.01, idle_timeout_sec=0.3)
    batches = list(reader.batches(4))
    assert [b.num_records for b in batches] == [4, 4, 2, 4, 4, 2]
    assert _sids(batches) == list(range(20))
    ids, lengths = batches[1].records.id_lists["tags"]
    assert lengths.tolist() == [1, 2, 0, 1] and ids.tolist() == [0, 0, 1, 0]
    assert batches[1].records.id_lists["user"][0].tolist() == [104, 105, 106, 107]
    assert batches[4].start == StreamPosition("part-1.parquet", 0, 4)
    again = reader.read(batches[4].start, batches[4].end)
    assert again.records.values["sid"].tolist() == [14, 15, 16, 17]
    resumed = StreamReader(tmp_path, ParquetFormat(columns), pattern="*.parquet",
                           poll_interval_sec=0.01, idle_timeout_sec=0.3)
    assert _sids(resumed.batches(4, start=batches[4].start)) == list(range(14, 20))
    with pytest.raises(ValueError, match="cannot read the Parquet columns"):
        StreamReader(tmp_path, ParquetFormat((CsvColumn(name="nope", kind="int"),)),
                     idle_timeout_sec=0.3).batches(4).__next__()


def test_position_log_drops_a_torn_line_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "loader-0.positions"
    log = PositionLog(path)
    for seq in range(5):
        log.append(seq, StreamPosition("a.csv", 10 * seq, seq), StreamPosition("a.csv", 10 * seq + 10,
                                                                                 seq + 1))
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"seq": 5, "start": ["a.c')  # the process died mid-write
    reopened = PositionLog(path, keep_from=2)
    assert sorted(reopened.records) == [2, 3, 4]
    assert reopened.records[3] == (StreamPosition("a.csv", 30, 3), StreamPosition("a.csv", 40, 4))
    reopened.append(5, StreamPosition("a.csv", 50, 5), StreamPosition("a.csv", 60, 6))
    reopened.close()
    assert sorted(PositionLog(path).records) == [2, 3, 4, 5]
    assert path.read_bytes().count(b"\n") == 4


# -- metrics ------------------------------------------------------------------------------

def _samples(n: int = 6000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    groups = rng.integers(0, 40, n)
    labels = (rng.random(n) < 0.2 + 0.5 * (groups % 3 == 0)).astype(np.int64)
    scores = np.clip(rng.random(n) * 0.6 + 0.3 * labels, 0, 1).round(3)  # ties too
    return labels, scores, groups


def _reference_gauc(labels, scores, groups) -> float:
    """Per-group AUC by the exact rank formula, one group at a time (the reference)."""
    from persia_py.metrics import roc_auc

    aucs, weights = [], []
    for g in np.unique(groups):
        mask = groups == g
        if 0 < labels[mask].sum() < mask.sum():
            aucs.append(roc_auc(labels[mask], scores[mask]))
            weights.append(mask.sum())
    return float(np.average(aucs, weights=weights))


def test_single_process_metrics_match_references() -> None:
    from persia_py.metrics import BinaryStats, gauc, log_loss, normalized_entropy, roc_auc

    labels, scores, groups = _samples()
    p = np.clip(scores, 1e-7, 1 - 1e-7)
    expected_loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    ctr = labels.mean()
    assert log_loss(labels, scores) == pytest.approx(expected_loss, rel=1e-12)
    assert normalized_entropy(labels, scores) == pytest.approx(
        expected_loss / -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr)), rel=1e-12)
    assert gauc(labels, scores, groups) == pytest.approx(_reference_gauc(labels, scores, groups),
                                                         abs=1e-12)
    stats = BinaryStats(num_bins=1000)  # scores on a 0.001 grid: every bin one score
    stats.update(labels[:100], scores[:100])
    stats.update(labels[100:], scores[100:])
    assert stats.auc() == pytest.approx(roc_auc(labels, scores), abs=1e-12)
    assert stats.log_loss() == pytest.approx(expected_loss, rel=1e-12)
    with pytest.raises(ValueError, match="probabilities"):
        stats.update([1], [1.5])
    with pytest.raises(ValueError, match="0 or 1"):
        log_loss([2], [0.5])


def _metrics_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: metrics of its half of the samples, reduced across both."""
    import torch.distributed as dist

    from persia_py.metrics import BinaryStats, distributed_gauc
    from persia_py.progressive import ProgressiveValidation

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    labels, scores, groups = _samples()
    half = slice(0, 2500) if rank == 0 else slice(2500, None)  # unequal shares
    stats = BinaryStats(num_bins=1000)
    stats.update(labels[half], scores[half])
    total = stats.all_reduced()
    pv = ProgressiveValidation(every_steps=2, group_by=lambda batch: batch)
    torch = __import__("torch")
    reports = []
    for chunk in np.array_split(np.arange(6000)[half], 4):  # 4 steps per rank, 2 reports
        pv.observe(groups[chunk], torch.tensor(scores[chunk]), [torch.tensor(labels[chunk])])
        reports.append(pv.after_step())
    np.save(os.path.join(out, f"rank{rank}.npy"), np.array(
        [total.auc(), total.log_loss(), total.normalized_entropy(),
         distributed_gauc(labels[half], scores[half], groups[half]),
         reports[1]["pv_auc"], reports[1]["pv_gauc"], reports[3]["pv_logloss"],
         reports[1]["pv_samples"] + reports[3]["pv_samples"], reports[0] is None]))
    dist.destroy_process_group()


@pytest.mark.processes
def test_distributed_metrics_equal_single_process(tmp_path: Path) -> None:
    from persia_py.metrics import gauc, log_loss, normalized_entropy, roc_auc

    run_ranks(_metrics_rank, str(tmp_path), timeout=120)
    labels, scores, groups = _samples()
    results = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(results[0], results[1])  # every rank gets the same values
    auc, loss, ne, g_auc, pv_auc, pv_gauc, pv_loss, pv_samples, first_is_none = results[0]
    assert auc == pytest.approx(roc_auc(labels, scores), abs=1e-12)
    assert loss == pytest.approx(log_loss(labels, scores), rel=1e-12)
    assert ne == pytest.approx(normalized_entropy(labels, scores), rel=1e-12)
    assert g_auc == pytest.approx(gauc(labels, scores, groups), abs=1e-12)
    # Progressive validation reports the samples of its window (2 steps of each rank).
    first = np.r_[np.array_split(np.arange(2500), 4)[0], np.array_split(np.arange(2500), 4)[1],
                  np.array_split(np.arange(2500, 6000), 4)[0],
                  np.array_split(np.arange(2500, 6000), 4)[1]]
    last = np.setdiff1d(np.arange(6000), first)
    assert pv_auc == pytest.approx(roc_auc(labels[first], scores[first]), abs=1e-12)
    assert pv_gauc == pytest.approx(gauc(labels[first], scores[first], groups[first]), abs=1e-12)
    # (the model's outputs are float32: scores rounded to float32)
    assert pv_loss == pytest.approx(log_loss(labels[last], scores[last]), rel=1e-6)
    assert pv_samples == 6000 and first_is_none


def test_a_loader_waits_out_an_embedding_worker_outage_for_rpc_timeout_sec(caplog) -> None:
    """A put that meets an embedding worker down (restarting, or gone at a clean stop)
    retries for ``common_config.rpc_timeout_sec`` per attempt, the deadline its warning
    names (it was a fixed 10 s)."""
    from types import SimpleNamespace

    import grpc

    from persia_py.config import CommonConfig, GlobalConfig
    from persia_py.embedding.data import IDTypeFeatureWithSingleID, PersiaBatch
    from persia_py.env import PersiaEnv
    from persia_py.workers.data_loader import DataCtx
    from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection refused"

    common = CommonConfig(rpc_timeout_sec=42)
    worker = EmbeddingWorkerClient("127.0.0.1:0", common)  # never dialled: calls are faked
    deadlines = []

    def put_batch(request, timeout, wait_for_ready):
        deadlines.append(timeout)
        if len(deadlines) == 1:
            raise Unavailable()
        return SimpleNamespace(ref=7)

    worker._put_batch = put_batch
    ctx = DataCtx(port=0, env=PersiaEnv(embedding_worker_addrs=(worker.address,)),
                  global_config=GlobalConfig(common_config=common)).recover()
    batch = PersiaBatch([IDTypeFeatureWithSingleID("user", np.arange(4, dtype=np.uint64))],
                        requires_grad=False)
    try:
        with caplog.at_level("WARNING", logger="persia_py.wire.rpc"):
            assert ctx._put_ids(worker, batch, 5) == 7
    finally:
        worker.close()
    assert "embedding worker 127.0.0.1:0 unavailable (connection refused); waiting and " \
           "retrying until the call's deadline (42 s, common_config.rpc_timeout_sec)" \
           in caplog.text, caplog.text
    assert 41 < deadlines[0] <= 42 and deadlines[1] < deadlines[0]


def test_sigterm_is_noted_not_fatal_and_the_handler_restored() -> None:
    import signal as signal_module

    import torch

    from persia_py.dense.graceful_stop import StopOnSignal

    before = signal_module.getsignal(signal_module.SIGTERM)
    stop = StopOnSignal(torch.device("cpu"))
    stop.install()
    try:
        assert not stop.agreed() and not stop.stopped
        os.kill(os.getpid(), signal_module.SIGTERM)  # handled in this (the main) thread
        assert stop.requested and stop.agreed() and stop.stopped
    finally:
        stop.restore()
    assert signal_module.getsignal(signal_module.SIGTERM) == before
