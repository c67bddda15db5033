"""The checks of update-log records (``persia_py.servers.record_sum``): ``lanes64`` notices
any one changed byte and any change of length, wherever it falls (lanes, leftover words,
last bytes), and its values are fixed: a log written by this version replays in the next."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from persia_py.servers.record_sum import SUMS, lanes64


def _random(length: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


def _with_byte_changed(data: bytes, at: int, delta: int) -> bytes:
    changed = bytearray(data)
    changed[at] = (changed[at] + delta) % 256
    return bytes(changed)


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 200])
def test_one_changed_byte_or_length_always_changes_the_check(length) -> None:
    data = _random(length, length)
    check = lanes64(data)
    for at in range(length):
        for delta in (1, 0x80, 0xFF):
            assert lanes64(_with_byte_changed(data, at, delta)) != check, f"byte {at}"
    assert lanes64(data + b"\0") != check  # one zero more: the length is in the check
    if length:
        assert lanes64(data[:-1]) != check


def test_changes_anywhere_in_a_long_record_change_the_check() -> None:
    data = _random(1 << 20, 1)
    check = lanes64(data)
    for at in np.random.default_rng(2).integers(0, len(data), 300):
        assert lanes64(_with_byte_changed(data, int(at), 1)) != check, f"byte {at}"
    # Runs of zeros of different lengths (a torn record's padding) differ too.
    zeros = {lanes64(bytes(n)) for n in range(0, 4096, 8)}
    assert len(zeros) == 512


def test_the_check_reads_unaligned_memory_and_every_buffer_type_alike() -> None:
    data = _random(1000, 3)
    padded = memoryview(b"x" + data)[1:]  # starts one byte past an aligned address
    assert lanes64(padded) == lanes64(data) == lanes64(bytearray(data))
    assert lanes64(np.frombuffer(data, np.uint8)) == lanes64(data)


def test_the_values_are_fixed_from_version_to_version() -> None:
    """Changing them would make the segments an older version wrote unreadable: a new
    check takes a new name in ``record_sum.SUMS`` (a segment's header names its own)."""
    assert [lanes64(b""), lanes64(b"persia"), lanes64(bytes(range(256)) * 3)] == [
        673992558, 2660346743, 3694419860]


def test_crc32_is_zlibs() -> None:
    data = _random(5000, 4)
    assert SUMS["crc32"](data) == zlib.crc32(data)
