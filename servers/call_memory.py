"""How much memory a parameter server's Lookup or Update may take, checked before
anything is allocated for it.

The wire layer caps what a request decodes to (lz4 payloads included) at
``max_message_bytes``. Serving the request takes more: the rows an update finds and the
order that sums repeated ids, a float32 copy of float16 gradients, the rows a lookup
gathers before they are narrowed or compressed, the copy of the answer gRPC takes to
send it. A call whose decoded arrays plus that work would pass
:data:`WORK_PER_MESSAGE_LIMIT` times ``max_message_bytes`` is refused (ValueError,
naming the limit) before any of it is allocated, and an answer is refused
unless it fits in ``max_message_bytes`` with its framing, so that no answer is built
only to be refused by gRPC on the way out. Together a call stays under twice
``max_message_bytes`` (``tests/test_token_holder.py`` reads a server's peak).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from persia_py.wire import codec

WORK_PER_MESSAGE_LIMIT = 1.5
"""A call's decoded arrays and working memory, in units of ``max_message_bytes``; the
rest, to twice the limit, is left for the allocator's slack."""
UPDATE_BYTES_PER_ID = 40
"""Working memory an update takes per id beside its arrays: the table row of each id and
the grouping that sums the gradients of repeated ids (measured with tracemalloc: 16 bytes
per id when the ids are distinct, 40 when one id repeats throughout)."""
LOOKUP_BYTES_PER_ID = 16
"""Working memory a lookup takes per id beside its answer (the slot each id hashes to,
the row it finds)."""


def _refuse(what: str, need: int, limit: int, advice: str) -> None:
    raise ValueError(f"{what} would take {need} bytes of memory to serve, over "
                     f"{WORK_PER_MESSAGE_LIMIT} x common_config.max_message_bytes ({limit}); "
                     f"{advice}")


def _itemsize(dtype: str) -> int:
    """Bytes per value of a wire dtype (0 for a name decoding refuses)."""
    return np.dtype(dtype).itemsize if dtype in codec.WIRE_DTYPES else 0


def check_update(tables: list[tuple[int, int, str]], limit: int) -> None:
    """Refuse an update of ``tables`` (each: its number of ids, its gradients' number of
    values and dtype name) that would take too much memory; ``limit``: max_message_bytes.
    Callable with the sizes a request claims, before its arrays are decoded."""
    num_ids = sum(n for n, _, _ in tables)
    need = UPDATE_BYTES_PER_ID * num_ids + sum(  # ids, gradients, and float32 ones to apply
        8 * n + size * (_itemsize(dtype) + (0 if dtype == "float32" else 4))
        for n, size, dtype in tables)
    if need > WORK_PER_MESSAGE_LIMIT * limit:
        _refuse(f"an update of {num_ids} ids", need, limit, "send fewer ids per call")


@dataclass(frozen=True)
class LookupAnswer:
    """How a lookup's rows travel back: float16 (``fp16``), lz4-compressed (``lz4``)."""

    fp16: bool = False
    lz4: bool = False

    @property
    def dtype(self) -> str:
        return "float16" if self.fp16 else "float32"

    def in_place(self) -> bool:
        """Whether the rows are written straight into the answer's bytes (float32,
        uncompressed); otherwise they are gathered first and converted into it."""
        return not (self.fp16 or self.lz4)

    def message_bytes(self, shapes: list[tuple[int, int]]) -> int:
        """The answer's serialized size (its most, compressed)."""
        itemsize = np.dtype(self.dtype).itemsize
        sizes = [n * dim * itemsize for n, dim in shapes]
        if self.lz4:  # the framing of the largest data, and data that may not shrink
            return sum(codec.tensor_field_size(1, self.dtype, s, codec.lz4_bound(b), True)
                       for s, b in zip(shapes, sizes))
        return sum(codec.tensor_field_size(1, self.dtype, s, b) for s, b in zip(shapes, sizes))

    def check(self, ids: list[np.ndarray], shapes: list[tuple[int, int]], limit: int) -> None:
        """Refuse the lookup of ``ids`` (answered in ``shapes``) if its answer would not
        fit in ``limit`` or serving it would take too much memory."""
        answer = self.message_bytes(shapes)
        if answer > limit:
            raise ValueError(f"the answer would carry {answer} bytes, over max_message_bytes "
                             f"{limit} (common_config; framing included); look up fewer ids "
                             "per call")
        gathered = 0 if self.in_place() else sum(4 * n * dim for n, dim in shapes)
        # The message, gRPC's copy of it to send, and with lz4 the compressed pieces
        # joined into the message.
        need = (sum(i.nbytes for i in ids) + LOOKUP_BYTES_PER_ID * sum(i.size for i in ids)
                + gathered + answer * (3 if self.lz4 else 2))
        if need > WORK_PER_MESSAGE_LIMIT * limit:
            _refuse(f"a lookup of {sum(i.size for i in ids)} ids", need, limit,
                    "look up fewer ids per call")


__all__ = ["LOOKUP_BYTES_PER_ID", "LookupAnswer", "UPDATE_BYTES_PER_ID",
           "WORK_PER_MESSAGE_LIMIT", "check_update"]
