"""A data loader's handover log (``persia_py.workers.handover_log``) and the queue's side of
a loader restarted alone: what it says the dead loader handed over, finished or not, and
how a request retried after the crash gets its batch again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from persia_py.ids.positions import Position, batch_id
from persia_py.proto import data_loader_pb2 as pb
from persia_py.wire.rpc import Overloaded
from persia_py.workers.handover_log import (
    Handover,
    HandoverLog,
    HandoverLogError,
    read_handovers,
)
from persia_py.workers.loader_service import BatchQueue, DataLoaderServicer


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
    from persia_py.checkpoint import rewind
    from persia_py.ids.positions import DataPositions
    from persia_py.proto import common_pb2

    positions = DataPositions({0: Position(7, frozenset({9})), 1: Position(4)})
    request = common_pb2.RestartRequest(reason="test", positions=positions.to_text())
    without_log = DataLoaderServicer(BatchQueue(4, 1), loader_index=1)
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: .*keeps no handover log"):
        without_log.Rewind(request, _Context())

    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False)
    log.stream("loader1-abc")
    servicer = DataLoaderServicer(BatchQueue(4, 1, log), loader_index=1, num_made=lambda: 4)
    context = _Context()
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: .*RestartRequest.positions: not JSON"):
        servicer.Rewind(common_pb2.RestartRequest(positions="{"), context)
    assert not rewind.rewind_file(path).exists() and not context.callbacks  # nothing written
    answer = servicer.Rewind(request, context)
    assert answer.instance == rewind.INSTANCE and len(context.callbacks) == 1
    # Tagged with the log's stream: only a restart replaying that log takes it.
    assert rewind.read_rewind(path, stream="loader1-abc").to_json() == positions.to_json()


def _rewind(servicer, positions: dict) -> tuple[str | None, _Context]:
    """Ask ``servicer`` to rewind to ``positions`` (JSON): (the refusal, or None; context)."""
    import json

    from persia_py.proto import common_pb2

    context = _Context()
    try:
        servicer.Rewind(common_pb2.RestartRequest(positions=json.dumps(positions)), context)
    except RuntimeError as exc:
        return str(exc), context
    return None, context


def test_a_rewind_names_only_batches_the_loader_made(tmp_path: Path) -> None:
    """A loader that has made batches 0..9 refuses positions that hold a later one as
    trained (it would skip batches nobody trained; a stream's position log would drop
    the records of those to come), writing nothing; positions up to what it made pass."""
    from persia_py.checkpoint import rewind

    path = tmp_path / "handovers.log"
    made = [10]
    log = HandoverLog(path, replay=False)
    log.stream("loader1-abc")
    servicer = DataLoaderServicer(BatchQueue(4, 1, log), loader_index=1,
                                  num_made=lambda: made[0])
    for position in ({"next": 11, "also": []}, {"next": 1 << 39, "also": []},
                     {"next": 7, "also": [8, 10]}):
        refused, context = _rewind(servicer, {"1": position})
        assert refused is not None and refused.startswith(
            "INVALID_ARGUMENT: Rewind: RestartRequest.positions[1]: data loader 1 has made "
            "only the batches of sequence numbers below 10"), refused
        assert not rewind.rewind_file(path).exists() and not context.callbacks
    # Another loader's position is that loader's to check.
    accepted = {"0": {"next": 1 << 39, "also": []}, "1": {"next": 7, "also": [8, 9]}}
    refused, context = _rewind(servicer, accepted)
    assert refused is None and len(context.callbacks) == 1
    assert rewind.read_rewind(path, stream="loader1-abc").to_json() == accepted
    made[0] = 12
    assert _rewind(servicer, {"1": {"next": 12, "also": []}})[0] is None


def test_a_loader_counts_the_batches_made_before_it_started(tmp_path: Path) -> None:
    """What a loader has made counts those trained before the checkpoint it resumed and
    those its dead predecessor handed over (a checkpoint may hold them as trained)."""
    from persia_py.config import GlobalConfig
    from persia_py.env import PersiaEnv
    from persia_py.ids.positions import DataPositions
    from persia_py.workers.data_loader import DataCtx

    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False, trained=Position(3))
    for seq in (3, 4, 5, 6):
        log.handed(Handover(seq, 0, b"c" * 16, seq))
    log.done([3, 5])
    log.close()

    def loader(**env) -> DataCtx:
        return DataCtx(env=PersiaEnv(embedding_worker_addrs=("127.0.0.1:1",), **env),
                       global_config=GlobalConfig()).recover()

    assert loader().num_made == 0
    resumed = loader(data_positions=DataPositions({0: Position(5, frozenset({8}))}))
    assert resumed.num_made == 9
    restarted = loader(data_loader_handover_log=str(path), data_loader_replay=True)
    assert restarted.num_made == 7  # batch 6 handed over, in training
    restarted.log.close()


def test_a_rewind_refuses_deep_or_large_json_as_invalid_argument(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Through gRPC: positions nested deeper than their shape, or over their byte bound,
    get INVALID_ARGUMENT naming the problem (a deep text made the parser recurse and the
    call answer INTERNAL); nothing is written."""
    import json

    import grpc

    from persia_py.checkpoint import rewind
    from persia_py.config import CommonConfig
    from persia_py.ids.positions import MAX_POSITIONS_BYTES
    from persia_py.proto import common_pb2, data_loader_pb2_grpc
    from persia_py.wire.rpc import create_channel, create_server

    exits = []
    monkeypatch.setattr(rewind, "exit_after_answer", lambda context, what: exits.append(what))
    # Control calls may be larger than the positions' own bound here, to reach it.
    common = CommonConfig(max_control_message_bytes=4 * MAX_POSITIONS_BYTES)
    path = tmp_path / "handovers.log"
    server, port = create_server("127.0.0.1:0", common, max_workers=2)
    data_loader_pb2_grpc.add_DataLoaderServicer_to_server(DataLoaderServicer(
        BatchQueue(4, 1, HandoverLog(path, replay=False)), loader_index=0,
        num_made=lambda: 1 << 40), server)
    server.start()
    channel = create_channel(f"127.0.0.1:{port}", common)
    stub = data_loader_pb2_grpc.DataLoaderStub(channel)
    also = list(range(1, MAX_POSITIONS_BYTES // 7))
    try:
        for text, problem in (
                ("[" * 100_000 + "]" * 100_000, "JSON nested 100000 deep, deeper than 3"),
                ('{"0": {"next": 0, "also": [[[[1]]]]}}', "JSON nested 6 deep, deeper than 3"),
                (json.dumps({"0": {"next": 0, "also": also}}),
                 f"bytes of JSON, over the bound of {MAX_POSITIONS_BYTES}")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Rewind(common_pb2.RestartRequest(positions=text), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "RestartRequest.positions: " in refused.value.details()
            assert problem in refused.value.details(), refused.value.details()[:500]
        assert not rewind.rewind_file(path).exists() and exits == []
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("line", [
    b'{"handed":5,"rank":0}',  # keys missing
    b'{"handed":5,"rank":0,"consumer":"zz","request":1}',  # not hex
    b'{"handed":"5","rank":0,"consumer":"00","request":1}',
    b'{"done":"12"}',
    b'{"ended":-1}',
    b'{"stream":7}',
    b'{"finished":{"next":3}}',
    b'{"stream":"s","extra":1}',
    b'[1,2]',
    b'5',
])
def test_a_record_a_loader_never_writes_stops_the_start_naming_file_and_offset(
        tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "handovers.log"
    log = HandoverLog(path, replay=False)
    log.stream("loader0-abc")
    log.handed(Handover(1, 0, b"c" * 16, 3))
    log.close()
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(line + b"\n" + b'{"done":[1]}\n')
    where = re.escape(f"{path} line 3 (byte {offset})")
    with pytest.raises(HandoverLogError, match=where):
        HandoverLog(path, replay=True)  # what a restarted loader's DataCtx opens
