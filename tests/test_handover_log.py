"""A data loader's handover log (``persia_py.workers.handover_log``) and the queue's side of
a loader restarted alone: what it says the dead loader handed over, finished or not, and
how a request retried after the crash gets its batch again."""

from __future__ import annotations

from pathlib import Path

import pytest

from persia_py.data_position import Position, batch_id
from persia_py.proto import data_loader_pb2 as pb
from persia_py.rpc import Overloaded
from persia_py.workers.data_loader import BatchQueue, DataLoaderServicer
from persia_py.workers.handover_log import Handover, HandoverLog, read_handovers


def test_the_log_says_what_was_finished_in_training_and_last_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False)
    log.stream("loader0-abc")
    for seq, rank in ((0, 0), (1, 1), (2, 0), (3, 1), (4, 0)):
        log.handed(Handover(seq, rank, bytes([rank]) * 16, 10 + seq))
    log.done([0, 1, 3, 99])  # 99 was never handed by this log's loader: ignored
    log.ended(1)
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"done":[2')  # the process died inside this write
    state = read_handovers(path)
    assert state.stream == "loader0-abc"
    assert state.finished == Position(2, frozenset({3}))
    assert sorted(state.in_training) == [2, 4]
    # Rank 1's last batch is finished: its request is never retried.
    assert state.last == {0: Handover(4, 0, bytes([0]) * 16, 14)}
    assert state.ended == {1}
    # Replaying appends after a whole line; a new start begins an empty log.
    again = HandoverLog(path, replay=True)
    again.done([4])
    again.close()
    assert sorted(read_handovers(path).in_training) == [2]
    HandoverLog(path, replay=False).close()
    assert read_handovers(path).stream is None and path.read_bytes() == b""


def test_a_restarted_queue_waits_for_its_batches_then_answers_a_retry_alike(tmp_path) -> None:
    path = tmp_path / "handovers.log"
    first = HandoverLog(path, replay=False)
    first.handed(Handover(7, 0, b"c" * 16, 3))
    first.close()
    log = HandoverLog(path, replay=True)
    queue = BatchQueue(4, 2, log)
    queue.recover(log.recovered)
    with pytest.raises(Overloaded, match="making again the batches"):
        queue.next(0, 0.01, b"c" * 16, 3)
    again = pb.NextBatchResponse(batch=pb.Batch(batch_id=7), has_batch=True)
    queue.rebuilt(0, lambda: again)
    queue.ready()
    assert queue.next(0, 0.01, b"c" * 16, 3) == again  # the retry of the lost answer
    assert queue.next(0, 0.01, b"c" * 16, 3) == again
    queue.put(pb.Batch(batch_id=8))
    assert queue.next(1, 0.01, b"d" * 16, 1).batch.batch_id == 8  # a new request: logged
    log.close()
    assert read_handovers(path).last[1] == Handover(8, 1, b"d" * 16, 1)


def test_the_log_is_compacted_to_what_it_says(tmp_path: Path) -> None:
    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False, trained=Position(5), compact_every=50)
    log.stream("loader0-abc")
    for seq in range(5, 305):
        log.handed(Handover(seq, seq % 2, bytes([seq % 2]) * 16, seq))
        if seq % 7:  # every 7th batch stays in training
            log.done([seq])
    log.ended(0)
    log.close()
    state = read_handovers(path)
    assert len(path.read_bytes().splitlines()) < 100  # 300 handovers, 258 dones, 1 end
    assert state.stream == "loader0-abc" and state.ended == {0}
    in_training = [s for s in range(5, 305) if s % 7 == 0]
    assert sorted(state.in_training) == in_training
    assert state.finished.next == 7 and all(
        state.finished.done(s) == (s % 7 != 0) for s in range(5, 305))
    assert state.in_training[294] == Handover(294, 0, bytes([0]) * 16, 294)


def test_only_this_loaders_batch_ids_are_logged_finished(tmp_path: Path) -> None:
    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False)
    log.handed(Handover(3, 0, b"c" * 16, 1))
    servicer = DataLoaderServicer(BatchQueue(4, 1, log), loader_index=1)
    # Loader 0's batch 3 is not this loader's: ignored; then loader 1's own batch 3.
    servicer.NextBatch(pb.NextBatchRequest(done=[batch_id(0, 3)], only_done=True), None)
    assert sorted(read_handovers(path).in_training) == [3]
    servicer.NextBatch(pb.NextBatchRequest(done=[batch_id(1, 3)], only_done=True), None)
    log.close()
    assert read_handovers(path).in_training == {}


class _Context:
    """A servicer context that records what the call asked for."""

    def __init__(self) -> None:
        self.callbacks = []

    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback)  # would exit the process: never called here


def test_a_rewind_leaves_the_positions_beside_the_log_then_exits(tmp_path: Path) -> None:
    from persia_py import rewind
    from persia_py.data_position import DataPositions
    from persia_py.proto import common_pb2

    positions = DataPositions({0: Position(7, frozenset({9})), 1: Position(4)})
    request = common_pb2.RestartRequest(reason="test", positions=positions.to_env())
    without_log = DataLoaderServicer(BatchQueue(4, 1), loader_index=1)
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: .*keeps no handover log"):
        without_log.Rewind(request, _Context())

    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False)
    log.stream("loader1-abc")
    servicer = DataLoaderServicer(BatchQueue(4, 1, log), loader_index=1)
    context = _Context()
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: .*RestartRequest.positions: not JSON"):
        servicer.Rewind(common_pb2.RestartRequest(positions="{"), context)
    assert not rewind.rewind_file(path).exists() and not context.callbacks  # nothing written
    answer = servicer.Rewind(request, context)
    assert answer.instance == rewind.INSTANCE and len(context.callbacks) == 1
    # Tagged with the log's stream: only a restart replaying that log takes it.
    assert rewind.read_rewind(path, stream="loader1-abc").to_json() == positions.to_json()
