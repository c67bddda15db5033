"""A batch's routing plan against a plain per-id reference: every replica gets exactly the
ids it owns, the answers come back in the ids' order, and each replica's gradients are the
rows of its ids (a group's slots summed per id, skipped slots' ids left out)."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.ids.routing import replica_of
from persia_py.workers.routing_plan import RoutingPlan

DIM = 4


def _row_of(ids: np.ndarray) -> np.ndarray:
    """A row per id that names it (what a replica would answer for it)."""
    return np.stack([(ids % np.uint64(1000 + k)).astype(np.float32) for k in range(DIM)], 1)


def _plan(num_replicas: int, rng: np.random.Generator) -> tuple[RoutingPlan, dict]:
    unique = {  # each slot's distinct ids; "b" and "c" share table "bc", overlapping
        "a": rng.choice(2**40, 300, replace=False).astype(np.uint64),
        "b": np.arange(100, 250, dtype=np.uint64),
        "c": np.arange(200, 400, dtype=np.uint64)[::-1].copy(),
    }
    return RoutingPlan.of_slots(unique, lambda s: "bc" if s in "bc" else s, num_replicas), unique


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_lookups_reach_the_owning_replica_and_answers_come_back_in_order(num_replicas) -> None:
    plan, unique = _plan(num_replicas, np.random.default_rng(0))
    requests = plan.lookup_requests()
    assert len(requests) == num_replicas
    for r, request in enumerate(requests):
        assert [t for t, _ in request] == ["a", "bc"]
        for _, ids in request:
            assert (replica_of(ids, num_replicas) == r).all()
    for pos, table in enumerate(("a", "bc")):  # each distinct id asked once, of one replica
        asked = np.concatenate([request[pos][1] for request in requests])
        assert np.array_equal(np.sort(asked), np.sort(plan.tables[table].ids))
    answers = [[_row_of(ids) for _, ids in request] for request in requests]
    rows = plan.table_rows(answers)
    for table in ("a", "bc"):
        np.testing.assert_array_equal(rows[table], _row_of(plan.tables[table].ids))
    for slot, table in (("a", "a"), ("b", "bc"), ("c", "bc")):
        np.testing.assert_array_equal(plan.slot_rows(table, slot, rows[table]),
                                      _row_of(unique[slot]))


@pytest.mark.parametrize("num_replicas", [1, 3])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("skip_c", [False, True])
def test_each_replica_gets_the_gradients_of_its_ids(num_replicas, dtype, skip_c) -> None:
    rng = np.random.default_rng(1)
    plan, unique = _plan(num_replicas, rng)
    grads = {s: rng.standard_normal((ids.size, DIM)).astype(dtype) for s, ids in unique.items()}
    if skip_c:
        del grads["c"]
    expected: dict[str, dict[int, np.ndarray]] = {"a": {}, "bc": {}}  # per id, its sum
    for slot, g in grads.items():
        table = "a" if slot == "a" else "bc"
        for i, row in zip(unique[slot].tolist(), g):
            expected[table][i] = expected[table].get(i, 0) + row.astype(np.float32)
    sent: dict[str, dict[int, np.ndarray]] = {"a": {}, "bc": {}}
    for r, request in enumerate(plan.update_requests(grads)):
        for table, ids, rows in request:
            assert (replica_of(ids, num_replicas) == r).all()
            assert rows.shape == (ids.size, DIM) and rows.flags.c_contiguous
            assert rows.dtype == (dtype if table == "a" else np.float32)  # a group's sum
            for i, row in zip(ids.tolist(), rows):
                assert i not in sent[table]
                sent[table][i] = row
    for table in ("a", "bc"):
        assert sent[table].keys() == expected[table].keys()  # none lost, none extra
        for i, row in expected[table].items():
            np.testing.assert_allclose(sent[table][i], row, rtol=1e-6)
