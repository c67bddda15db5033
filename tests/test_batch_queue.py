"""A data loader's ``BatchQueue`` shares a burst among the NN ranks: a rank is handed at
most ``MAX_LEAD`` batches beyond the rank handed the fewest (of those the stream has not
ended for), since the ranks train in step and one holding a whole burst would wait in its
first collective for a rank that found none (tests/test_online_training.py runs it)."""

from __future__ import annotations

import threading

from persia_py.proto import data_loader_pb2 as pb
from persia_py.workers.handover_log import Handovers
from persia_py.workers.loader_service import MAX_LEAD, BatchQueue


def _queue(num_ranks: int, num_batches: int) -> BatchQueue:
    queue = BatchQueue(maxsize=32, num_consumers=num_ranks)
    for i in range(num_batches):
        queue.put(pb.Batch(batch_id=i))
    return queue


def _ask(queue: BatchQueue, rank: int, wait: float = 0.01) -> int | None:
    """The batch id ``rank`` is handed, None for an answer without a batch."""
    answer = queue.next(rank, wait)
    return answer.batch.batch_id if answer.has_batch else None


def test_a_burst_is_shared_with_a_rank_that_has_not_asked_yet() -> None:
    queue = _queue(2, 9)
    first = [_ask(queue, 0) for _ in range(9)]  # rank 0 asks for all before rank 1 asks
    assert first == [*range(MAX_LEAD), *[None] * (9 - MAX_LEAD)]
    assert _ask(queue, 1) == MAX_LEAD
    assert [_ask(queue, 0), _ask(queue, 0)] == [MAX_LEAD + 1, None]  # one more, then waits
    assert [_ask(queue, 1) for _ in range(3)] == [MAX_LEAD + 2, MAX_LEAD + 3, MAX_LEAD + 4]
    queue.finish()
    assert _ask(queue, 0) is None and queue.next(0, 0.01).end_of_stream  # nothing is left


def test_a_rank_past_the_lead_goes_as_soon_as_another_takes_a_batch() -> None:
    queue = _queue(2, MAX_LEAD + 2)
    assert [_ask(queue, 0) for _ in range(MAX_LEAD)] == list(range(MAX_LEAD))
    got: list[int | None] = []
    waiting = threading.Thread(target=lambda: got.append(_ask(queue, 0, wait=60)))
    waiting.start()
    assert _ask(queue, 1) in (MAX_LEAD, MAX_LEAD + 1)
    waiting.join(30)  # woken by rank 1's batch, long before its 60 s long poll
    assert not waiting.is_alive() and got[0] in (MAX_LEAD, MAX_LEAD + 1)


def test_ranks_the_stream_ended_for_hold_no_one_back() -> None:
    queue = _queue(2, 9)
    queue.recover(Handovers(ended={1}))  # a loader restarted after rank 1 was told the end
    queue.ready()
    assert [_ask(queue, 0) for _ in range(9)] == list(range(9))
