"""Calls whose arrays lie in shared memory (:mod:`persia_py.wire.shm`), for both pairs
of processes that share a host: an NN worker and its embedding worker, an embedding
worker and its parameter servers.

The caller (:class:`SegmentLender`) makes the segments and lends one per call: for an
answer's arrays (the server writes them there and answers where they lie) or for the
arrays it sends (it writes them there and the request says where). The server
(:class:`MappedSegments`) maps what a request names, with the checks of
:meth:`shm.Segment.open`; one it cannot map (another host, a restart, shared memory off
there) it refuses in its answer, having applied nothing, and the caller sends the arrays
in the message instead. A refusal that shows the server elsewhere turns both directions
off for good. A call that failed may still be running on the other side: its segment is
never lent again (:meth:`shm.SegmentPool.discard`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from persia_py.config import CommonConfig
from persia_py.proto import common_pb2
from persia_py.wire import codec, shm

__all__ = ["MappedSegments", "SegmentLender", "TensorData", "descriptor", "segment_message"]

_MAX_SEGMENTS = 16
"""Segments a caller makes per server and direction: more than the calls it has in flight
to that server at once (an NN worker's lookup threads and gradient sends, 8; an embedding
worker's parameter-server threads)."""

T = TypeVar("T")
TensorData = Callable[[Any, int], memoryview]
"""The bytes of a Tensor message (dtype and shape, no data) at an offset of a segment."""


def descriptor(message: Any) -> shm.Descriptor:
    """The :class:`shm.Descriptor` of a ShmSegment message (or its RawMessage)."""
    return shm.Descriptor(name=message.name, nonce=message.nonce, size=message.size)


def segment_message(d: shm.Descriptor) -> common_pb2.ShmSegment:
    return common_pb2.ShmSegment(name=d.name, nonce=d.nonce, size=d.size)


class MappedSegments:
    """A server's mappings of its callers' segments (None inside: shared memory off)."""

    def __init__(self, common: CommonConfig) -> None:
        self.cache = shm.SegmentCache(common.max_message_bytes) if common.shared_memory else None

    def segment(self, message: Any) -> shm.Segment:
        """The segment ``message`` describes, mapped; ShmUnavailable if it is not here
        (the caller then uses messages), ShmError if the descriptor is malformed."""
        if self.cache is None:
            raise shm.ShmUnavailable("shared memory is off on this server "
                                     "(common_config.shared_memory)")
        return self.cache.get(descriptor(message))

    def offered(self, message: Any) -> tuple[shm.Segment | None, str]:
        """The segment a request offers, mapped (None if it offers none, an absent
        sub-message having an empty name, or if it is not here), and why not."""
        if not message.name:
            return None, ""
        try:
            return self.segment(message), ""
        except shm.ShmUnavailable as exc:
            return None, str(exc)

    def forget(self, messages: Sequence[Any]) -> None:
        if self.cache is not None and messages:
            self.cache.forget([descriptor(m) for m in messages])


def _held(segment: shm.Segment, release: Callable[[], None]) -> TensorData:
    """Views of ``segment`` that keep it lent: ``release`` runs once none is left."""
    whole = np.frombuffer(segment.at(shm.HEADER_BYTES, segment.size - shm.HEADER_BYTES),
                          np.uint8)
    weakref.finalize(whole, release)

    def data(tensor: Any, offset: int) -> memoryview:
        piece = segment.tensor_data(tensor, offset)  # checks the bounds
        start = offset - shm.HEADER_BYTES
        return whole[start:start + len(piece)].data
    return data


class SegmentLender:
    """A caller's segments for one server: ``answers`` for what it answers, ``sends``
    for what the caller sends; None where shared memory is off."""

    def __init__(self, common: CommonConfig, server: str) -> None:
        self.server = server
        """Who the server is, for log lines (``embedding worker 10.0.0.1:5000``)."""
        on = common.shared_memory
        self.answers = shm.SegmentPool(common.max_message_bytes, _MAX_SEGMENTS) if on else None
        self.sends = shm.SegmentPool(common.max_message_bytes, _MAX_SEGMENTS) if on else None
        self.num_answers = 0
        """Answers read from shared memory (for metrics and tests)."""
        self.num_sends = 0
        """Calls whose arrays were sent through shared memory."""

    def pools(self) -> list[shm.SegmentPool]:
        return [p for p in (self.answers, self.sends) if p is not None]

    def close(self) -> None:
        for pool in self.pools():
            pool.close()

    def refused(self, pool: shm.SegmentPool, segment: shm.Segment, reason: str) -> None:
        """The server could not use ``segment``; when that shows it elsewhere (or too old
        to know segments: it answers without saying why), both directions go back to
        messages."""
        pool.refused(segment, f"{self.server}: {reason or 'no reason given'}")
        if not pool.enabled:
            for other in self.pools():
                other.disable(f"{self.server}: {reason}")

    def call_for_answer(self, build: Callable[[shm.Descriptor | None, list[shm.Descriptor]], Any],
                        call: Callable[[Callable[..., Any], Any], Any],
                        method: Callable[..., Any],
                        decode: Callable[[Any, TensorData | None], T], *,
                        hold: bool = False) -> T:
        """``decode(call(method, build(segment, forget)), data)``, with a segment lent for
        the answer's arrays when one is free (``data`` reads them; None: they are in the
        message). ``call`` runs ``method`` with its retries. ``hold``: the decoded arrays
        may be views of the segment, which is lent again once none is left; otherwise
        ``decode`` copies them out."""
        pool = self.answers
        segment = pool.acquire() if pool is not None else None
        if pool is None or segment is None:
            return decode(call(method, build(None, [])), None)
        attempts = 0

        def attempt(*args: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            attempts += 1
            return method(*args, **kwargs)

        try:
            answer = call(attempt, build(segment.descriptor, pool.take_forget()))
        except BaseException:
            pool.discard(segment)  # the call may still be writing into it
            raise
        if answer.shm.used:
            segment.used = True
            self.num_answers += 1
            # An attempt given up may still be writing into it: not lent again.
            lend_again = attempts == 1
            if hold:
                return decode(answer, _held(segment, lambda: pool.give_back_later(
                    segment, lend_again)))
            try:
                return decode(answer, segment.tensor_data)
            finally:
                (pool.give_back if lend_again else pool.discard)(segment)
        if answer.shm.needed_bytes:  # mapped, too small: a bigger one next time
            segment.used = True
            pool.need(answer.shm.needed_bytes)
            pool.discard(segment)
        else:
            self.refused(pool, segment, answer.shm.refused)
        return decode(answer, None)

    def call_with_arrays(self, arrays: Sequence[np.ndarray], dtypes: Sequence[str],
                         build: Callable[[shm.Descriptor, list[shm.Descriptor], list[int]], Any],
                         call: Callable[[Callable[..., Any], Any], Any],
                         method: Callable[..., Any]) -> Any | None:
        """``call(method, build(segment, forget, offsets))`` with ``arrays`` written into a
        lent segment (as ``dtypes``: floats narrowed where they differ) at ``offsets``;
        None if no segment is free or the server could not map it (nothing was applied:
        send the arrays in the message)."""
        pool = self.sends
        if pool is None:
            return None
        specs = [(d, a.shape) for a, d in zip(arrays, dtypes)]
        offsets, size = shm.layout(specs)
        segment = pool.acquire(size)
        if segment is None:
            return None
        try:
            for a, (dtype_name, shape), offset in zip(arrays, specs, offsets):
                out = segment.array(offset, dtype_name, shape)
                if a.dtype.name != dtype_name:
                    codec.cast_float(a, dtype_name, out=out)
                else:
                    np.copyto(out, a)
            answer = call(method, build(segment.descriptor, pool.take_forget(), offsets))
        except BaseException:
            pool.discard(segment)  # the call may still be reading it
            raise
        if not answer.shm.used:
            self.refused(pool, segment, answer.shm.refused)
            return None
        segment.used = True
        pool.give_back(segment)
        self.num_sends += 1
        return answer
