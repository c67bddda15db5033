"""A parameter-server replica's update log (``persia_py.servers.update_log``): a replica
started again from its log holds exactly what the one that died held, exactly-once
window included, whatever checkpoints were cut, completed, or loaded meanwhile."""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from persia_py.checkpoint import layout as fmt
from persia_py.config import (
    EmbeddingTablesConfig,
    GlobalConfig,
    ParameterServerConfig,
    SlotConfig,
)
from persia_py.servers.block_append import BLOCK, FRAME
from persia_py.servers.checkpoint import dump_replica, load_replica
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.replica_start import open_update_log
from persia_py.servers.update_log import _payload, _records, read_segments, replay_plan

EMBEDDING = EmbeddingTablesConfig(slots_config={"user": SlotConfig(dim=4), "item": SlotConfig(dim=8)})
ADAGRAD = {"type": "adagrad", "lr": 0.1}
GLOBAL = GlobalConfig(embedding_parameter_server_config=ParameterServerConfig(capacity=100_000))


def _ps(row_dtype: str = "float32") -> ParameterServer:
    return ParameterServer(GLOBAL, EmbeddingTablesConfig(slots_config=EMBEDDING.slots_config,
                                                         row_dtype=row_dtype))


class _Trainer:
    """Lookups and updates as an embedding worker sends them, one sequence number each."""

    def __init__(self, seed: int = 0, worker_id: str = "ew-1") -> None:
        self.rng, self.sequence = np.random.default_rng(seed), 0
        self.worker_id = worker_id
        self.sent: list[list] = []

    def steps(self, ps: ParameterServer, n: int) -> None:
        for _ in range(n):
            requests = []
            for slot, dim in (("user", 4), ("item", 8)):
                ids = np.unique(self.rng.integers(0, 3000, 300).astype(np.uint64))
                ps.lookup([(slot, ids)], training=True)
                requests.append((slot, ids, self.rng.normal(size=(ids.size, dim)).astype(np.float32)))
            self.sequence += 1
            self.sent.append(requests)
            assert ps.update(requests, worker_id=self.worker_id, sequence=self.sequence)[1] is False


def _same(a: ParameterServer, b: ParameterServer) -> None:
    one, two = a.state_dict(), b.state_dict()
    assert one.settings == two.settings
    for name in ("user", "item"):
        x, y = one.tables[name], two.tables[name]
        ox, oy = np.argsort(x["ids"]), np.argsort(y["ids"])
        for key in ("ids", "weights", "state"):
            np.testing.assert_array_equal(x[key][ox], y[key][oy], err_msg=f"{name} {key}")
    assert {w: sorted(s.tolist()) for w, s in one.seen.items()} == {
        w: sorted(s.tolist()) for w, s in two.seen.items()}


def _logged(folder: Path) -> ParameterServer:
    """A new replica logging into ``folder``, configured (Adagrad, seed 7)."""
    ps = _ps()
    open_update_log(ps, folder, replay=False, checkpoint=None, root=folder.parent)
    ps.configure(optimizer=ADAGRAD, seed=7)
    return ps


def _restart_holds_the_same(live: ParameterServer, log: Path, *, num_updates: int) -> None:
    restarted = _ps()
    assert open_update_log(restarted, log, replay=True, checkpoint=None,
                           root=log.parent).endswith(
        f"and {num_updates} updates replayed from its update log")
    _same(live, restarted)


def _checkpoint(ps: ParameterServer, root: Path, step: int, *, complete: bool = True) -> Path:
    tmp = fmt.new_tmp_dir(root)
    dump_replica(ps, tmp)
    if not complete:
        return tmp
    return fmt.commit(tmp, {"num_ps_replicas": 1, "rank_steps": [step]}, step=step)


def test_a_restarted_replica_holds_every_update_its_predecessor_applied(tmp_path: Path) -> None:
    log, root = tmp_path / "log", tmp_path / "ckpt"
    live = _ps()
    assert open_update_log(live, log, replay=True, checkpoint=None, root=tmp_path) == "a new update log"
    live.configure(optimizer=ADAGRAD, seed=7)
    trainer = _Trainer()
    trainer.steps(live, 5)
    _checkpoint(live, root, 5)
    trainer.steps(live, 4)
    _checkpoint(live, root, 9, complete=False)  # cut, never completed (the training died)
    trainer.steps(live, 3)
    # The process dies here: nothing is closed, the log holds what was written.
    restarted = _ps()
    what = open_update_log(restarted, log, replay=True, checkpoint=None, root=tmp_path)
    assert what.endswith("and 7 updates replayed from its update log"), what
    assert "checkpoint " + str(root) in what
    _same(live, restarted)
    # An update the dead replica applied, retried: acknowledged, not applied again.
    ids = np.array([1, 2], dtype=np.uint64)
    restarted.lookup([("user", ids)], training=True)
    assert restarted.update([("user", ids, np.ones((2, 4), np.float32))], worker_id="ew-1",
                            sequence=trainer.sequence) == (0, True)
    # It goes on logging where it left off; a second restart has both parts.
    trainer.steps(restarted, 2)
    again = _ps()
    open_update_log(again, log, replay=True, checkpoint=None, root=tmp_path)
    _same(restarted, again)


@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16"])
def test_half_rows_replay_bit_identical_from_a_checkpoint_of_them(tmp_path, row_dtype) -> None:
    """Stochastic rounding draws from the rows and the updates, not from a generator's
    state, so a replay on the checkpoint's rows makes the same choices, evaluation
    lookups (not logged) between the updates or not."""
    log, root = tmp_path / "log", tmp_path / "ckpt"
    live = _ps(row_dtype)
    open_update_log(live, log, replay=True, checkpoint=None, root=tmp_path)
    live.configure(optimizer=ADAGRAD, seed=7)
    trainer = _Trainer()
    trainer.steps(live, 3)
    _checkpoint(live, root, 3)
    for _ in range(3):
        live.lookup([("item", np.arange(1, 500, dtype=np.uint64))], training=False)
        trainer.steps(live, 1)
    restarted = _ps(row_dtype)
    what = open_update_log(restarted, log, replay=True, checkpoint=None, root=tmp_path)
    assert what.endswith("and 3 updates replayed from its update log"), what
    assert live.state_dict().tables["item"]["row_dtype"] == row_dtype
    _same(live, restarted)


def test_float16_gradients_are_logged_as_they_arrived_and_replay_bit_identical(tmp_path) -> None:
    """A float16 wire's gradients go into the log as float16 (half the bytes of float32),
    and the replay widens them exactly as the live update did."""
    sizes = {}
    for dtype in ("float16", "float32"):
        log = tmp_path / dtype
        live = _logged(log)
        rng = np.random.default_rng(3)
        for sequence in range(1, 4):
            ids = np.unique(rng.integers(0, 1 << 20, 4000).astype(np.uint64))
            live.lookup([("item", ids)], training=True)
            grads = rng.normal(scale=1e-3, size=(ids.size, 8)).astype(dtype)
            grads.setflags(write=False)  # as a view of a received request
            live.update([("item", ids, grads)], worker_id="ew-1", sequence=sequence)
        sizes[dtype] = sum(f.stat().st_size for f in log.iterdir())
        _restart_holds_the_same(live, log, num_updates=3)
    # per row: the lookup's id (8 B), then the update's id and 8 gradients: 32 B in
    # float16, 48 B in float32 (records padded to 4 KiB)
    assert sizes["float16"] < 0.75 * sizes["float32"], sizes


def test_without_any_checkpoint_the_log_configures_and_replays_from_empty(tmp_path) -> None:
    live = _ps()
    open_update_log(live, tmp_path, replay=False, checkpoint=None, root=tmp_path)
    live.configure(optimizer=ADAGRAD, seed=3)
    _Trainer(1).steps(live, 3)
    restarted = _ps()
    assert open_update_log(restarted, tmp_path, replay=True, checkpoint=None, root=tmp_path) == (
        "0 rows from no checkpoint and 3 updates replayed from its update log")
    assert restarted.configured
    _same(live, restarted)


def test_a_load_begins_a_new_timeline(tmp_path: Path) -> None:
    log, root = tmp_path / "log", tmp_path / "ckpt"
    live = _logged(log)
    trainer = _Trainer()
    trainer.steps(live, 3)
    first = _checkpoint(live, root, 3)
    trainer.steps(live, 3)  # a rollback forgets these
    load_replica(live, first)
    assert [s.kind for s in read_segments(log)] == ["load"]
    _Trainer(5, "ew-after-the-rollback").steps(live, 2)
    _restart_holds_the_same(live, log, num_updates=2)


def test_a_record_cut_short_is_dropped_and_its_retry_makes_the_replica_whole(tmp_path) -> None:
    live = _logged(tmp_path)
    trainer = _Trainer()
    trainer.steps(live, 2)
    segment = read_segments(tmp_path)[-1].path
    trainer.steps(live, 1)
    # Died inside the write of the last update (a record of ~19 KB): past its padding
    # (under one block), into its payload.
    torn = segment.stat().st_size - BLOCK - 10
    os.truncate(segment, torn)
    restarted = _ps()
    assert open_update_log(restarted, tmp_path, replay=True, checkpoint=None, root=tmp_path).endswith(
        "and 2 updates replayed from its update log")
    assert segment.stat().st_size < torn  # the torn record is gone
    # That update was never acknowledged: the embedding worker sends it again.
    requests = trainer.sent[-1]
    for name, ids, _ in requests:
        restarted.lookup([(name, ids)], training=True)
    assert restarted.update(requests, worker_id="ew-1", sequence=trainer.sequence)[1] is False
    _same(live, restarted)
    replayed = _ps()
    open_update_log(replayed, tmp_path, replay=True, checkpoint=None, root=tmp_path)
    _same(live, replayed)


def test_a_failed_append_deletes_the_log_and_the_next_cut_starts_one(tmp_path, caplog) -> None:
    log, root = tmp_path / "log", tmp_path / "ckpt"
    live = _logged(log)
    trainer = _Trainer()
    trainer.steps(live, 2)
    _checkpoint(live, root, 2)
    os.close(live.update_log._fd)  # the disk fails under it
    trainer.steps(live, 1)
    assert "the log is deleted and logging stops until the next checkpoint" in caplog.text
    assert read_segments(log) == [] and replay_plan(log, tmp_path) == []
    trainer.steps(live, 1)
    _checkpoint(live, root, 4)  # logging resumes from this cut
    trainer.steps(live, 2)
    _restart_holds_the_same(live, log, num_updates=2)


def test_a_log_no_checkpoint_cuts_stops_at_its_size_limit(tmp_path, caplog) -> None:
    live = _ps()
    open_update_log(live, tmp_path / "log", replay=False, checkpoint=None, root=tmp_path, max_bytes=200_000)
    live.configure(optimizer=ADAGRAD, seed=7)
    trainer = _Trainer()
    trainer.steps(live, 10)
    assert "would outgrow 200000 bytes (no checkpoint cut it" in caplog.text
    assert read_segments(tmp_path / "log") == []
    _checkpoint(live, tmp_path / "ckpt", 10)  # a cut starts it again, within the limit
    trainer.steps(live, 1)
    _restart_holds_the_same(live, tmp_path / "log", num_updates=1)


def test_with_an_empty_log_a_restart_loads_the_checkpoint_it_is_given(tmp_path) -> None:
    live = _ps_configured()
    _Trainer().steps(live, 2)
    checkpoint = _checkpoint(live, tmp_path / "ckpt", 2)
    restarted = _ps()
    what = open_update_log(restarted, tmp_path / "log", replay=True, checkpoint=tmp_path / "ckpt",
                           root=tmp_path)
    num_rows = sum(rows["ids"].size for rows in live.state_dict().tables.values())
    assert what == f"{num_rows} rows from checkpoint {checkpoint}, a new update log"
    assert [s.kind for s in read_segments(tmp_path / "log")] == ["load"]
    _same(live, restarted)


def _ps_configured() -> ParameterServer:
    ps = _ps()
    ps.configure(optimizer=ADAGRAD, seed=7)
    return ps


def test_a_new_start_deletes_what_the_log_held(tmp_path: Path) -> None:
    live = _logged(tmp_path)
    _Trainer().steps(live, 2)
    fresh = _ps()
    assert open_update_log(fresh, tmp_path, replay=False, checkpoint=None,
                           root=tmp_path) == "a new update log"
    assert not fresh.configured and [s.kind for s in read_segments(tmp_path)] == ["start"]


def test_a_serving_replica_refuses_an_update_log(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keeps no update log"):
        open_update_log(ParameterServer(GLOBAL, EMBEDDING, inference=True), tmp_path,
                        replay=False, checkpoint=None, root=tmp_path)


def test_records_are_whole_blocks_and_a_zeroed_tail_is_a_torn_record(tmp_path) -> None:
    """Every record is padded to a block (O_DIRECT needs it); a tail of zeros (blocks a
    dying write allocated but never filled) is dropped like any torn record."""
    live = _logged(tmp_path)
    _Trainer().steps(live, 3)
    segment = read_segments(tmp_path)[-1]
    assert segment.block == BLOCK and segment.path.stat().st_size % BLOCK == 0
    with open(segment.path, "ab") as f:
        f.write(bytes(3 * BLOCK))
    _restart_holds_the_same(live, tmp_path, num_updates=3)
    assert segment.path.stat().st_size % BLOCK == 0  # appending goes on aligned


def test_a_changed_byte_in_a_record_is_found_where_it_lies(tmp_path) -> None:
    """The records after the header carry the header's ``lanes64`` check: one byte of an
    update's gradients changed is an error naming the segment and the record's offset
    where a damaged record is an error, and the end of what is read where it is not."""
    live = _logged(tmp_path)
    _Trainer().steps(live, 3)
    segment = read_segments(tmp_path)[-1]
    assert segment.check == "lanes64"
    ends = [end for _, _, end in _raw_records(segment.path, ends=True)]
    # Records: header, configure, then per step two lookups and an update; the update of
    # step 2 begins at ends[-5]: ids (2.4 KB) then gradients past its JSON part.
    data = bytearray(segment.path.read_bytes())
    data[ends[-5] + 3000] ^= 0x10
    segment.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{re.escape(str(segment.path))} at byte "
                                         rf"{ends[-5]}: a record is cut short or damaged"):
        list(_raw_records(segment.path))
    with open(segment.path, "rb") as f:
        assert [end for _, _, end in _records(f, segment.path, tolerate_tail=True)] == ends[:-4]


def test_a_header_naming_an_unknown_check_stops_the_start(tmp_path) -> None:
    live = _logged(tmp_path)
    _Trainer().steps(live, 1)
    segment = read_segments(tmp_path)[-1].path
    _rewrite_header(segment, sum="md5")
    with pytest.raises(ValueError, match=rf"{re.escape(str(segment))}: the header's sum 'md5'"):
        read_segments(tmp_path)


def test_a_segment_written_before_padding_is_replayed_and_appended_to_unpadded(tmp_path) -> None:
    log = tmp_path / "log"
    live = _logged(log)
    _Trainer().steps(live, 2)
    live.update_log.close()
    # Rewrite the segment as the earlier format had it: no "block" nor "sum" (crc32
    # throughout), records back to back.
    segment = read_segments(log)[-1]
    records = list(_raw_records(segment.path))
    old = bytearray()
    for i, (meta, data) in enumerate(records):
        if i == 0:
            del meta["block"], meta["sum"]
        payload = b"".join(bytes(p) for p in _payload(json.dumps(meta).encode(),
                                                       [np.frombuffer(data, np.uint8)]))
        old += FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    segment.path.write_bytes(bytes(old))
    assert read_segments(log)[-1].block == 1
    restarted = _ps()
    assert open_update_log(restarted, log, replay=True, checkpoint=None, root=tmp_path).endswith(
        "and 2 updates replayed from its update log")
    _same(live, restarted)
    trainer = _Trainer(seed=5, worker_id="ew-2")
    trainer.steps(restarted, 1)  # appended unpadded to the old segment
    assert segment.path.stat().st_size % BLOCK != 0
    again = _ps()
    open_update_log(again, log, replay=True, checkpoint=None, root=tmp_path)
    _same(restarted, again)


def _raw_records(path: Path, *, ends: bool = False):
    """``(meta, data)`` of each record of ``path`` (``(meta, data, end)`` with ``ends``)."""
    with open(path, "rb") as f:
        for meta, data, end in _records(f, path, tolerate_tail=False):
            yield (meta, data, end) if ends else (meta, data)


def _rewrite_header(segment: Path, **changes: object) -> None:
    """``segment`` with its header record's fields changed (checksum and padding kept right)."""
    records = list(_raw_records(segment))
    meta, data = records[0]
    meta.update(changes)
    payload = b"".join(bytes(p) for p in _payload(json.dumps(meta).encode(),
                                                   [np.frombuffer(data, np.uint8)]))
    header = FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    rest = segment.read_bytes()[BLOCK:]
    segment.write_bytes(header + bytes(BLOCK - len(header)) + rest)


@pytest.mark.parametrize("base", ["outside/ckpt", "root/../outside/ckpt", "root", "relative"])
def test_a_header_naming_a_checkpoint_outside_the_root_stops_the_start(tmp_path, base) -> None:
    """A header is read from a file: one naming a checkpoint outside the checkpoint root
    (or the root itself, or a relative path) stops the restart with an error naming the
    segment and offset, before that checkpoint is opened; the replica stays empty."""
    root, log = tmp_path / "root", tmp_path / "log"
    root.mkdir()
    elsewhere = _logged(tmp_path / "other")
    _Trainer(seed=3).steps(elsewhere, 1)
    outside = _checkpoint(elsewhere, tmp_path / "outside", 1)  # complete, loadable
    (tmp_path / "outside" / "ckpt").symlink_to(outside)
    live = _logged(log)
    _Trainer().steps(live, 2)
    segment = read_segments(log)[-1].path
    named = base if base == "relative" else str(tmp_path / base)
    _rewrite_header(segment, kind="load", base=named)
    restarted = _ps()
    with pytest.raises(ValueError, match=rf"{re.escape(str(segment))} at byte 0: the header"):
        open_update_log(restarted, log, replay=True, checkpoint=None, root=root)
    assert not restarted.configured and restarted.export_seen() == {}
