"""Exact data positions (persia_py.ids.positions): what a checkpoint says each data
loader's trained batches are, and how a resumed loader skips exactly those."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.ids.positions import DataPositions, Position, batch_id, split_batch_ids


def test_batch_ids_split_back_into_loader_and_sequence() -> None:
    ids = np.array([batch_id(0, 0), batch_id(3, 7), batch_id(2**20, 2**40 - 1)], np.uint64)
    loaders, seqs = split_batch_ids(ids)
    assert loaders.tolist() == [0, 3, 2**20] and seqs.tolist() == [0, 7, 2**40 - 1]


def test_positions_advance_over_closed_gaps_and_keep_the_rest() -> None:
    # Two ranks took loader 0's batches 0..9 in turn; one is a step behind the other.
    position = Position().advanced([0, 2, 4, 6, 1, 3, 5, 9])
    assert (position.next, position.also) == (7, frozenset({9}))
    assert [s for s in range(12) if position.done(s)] == [0, 1, 2, 3, 4, 5, 6, 9]
    assert position.advanced([8, 7]) == Position(10, frozenset())


def test_positions_by_loader_round_trip_json_and_env() -> None:
    ids = [batch_id(0, s) for s in (0, 1, 3)] + [batch_id(1, s) for s in (0, 1, 2)]
    positions = DataPositions().advanced(ids)
    assert positions.to_json() == {"0": {"next": 2, "also": [3]}, "1": {"next": 3, "also": []}}
    again = DataPositions.from_text(positions.to_text(), "test")
    assert again.to_json() == positions.to_json()
    assert again.of(5) == Position()  # a loader never seen has done nothing
    assert DataPositions.from_text(None, "test").to_json() == {}


@pytest.mark.parametrize(("data", "message"), [
    ([1], "expected a mapping"),
    ({"x": {"next": 0, "also": []}}, "loader index 'x' is not a number"),
    ({"0": {"next": -1, "also": []}}, r"data_positions\[0\]: expected"),
    ({"0": {"next": 4, "also": [4]}}, r"ints above next"),
    ({"0": {"next": 4, "also": [], "more": 1}}, "expected"),
    ({"0": {"next": True, "also": []}}, "expected"),
])
def test_malformed_positions_are_refused_naming_where(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        DataPositions.from_json(data)


def test_a_malformed_environment_variable_is_named() -> None:
    with pytest.raises(ValueError, match=r"\$PERSIA_DATA_POSITIONS: not JSON"):
        DataPositions.from_text("{", "$PERSIA_DATA_POSITIONS")
