"""Vectorized parsing of complete CSV lines: the streaming readers' CSV path.

A batch's bytes are split on the newline, the delimiter and the id separator with array
operations over the whole buffer; there is no Python loop per row, field or id.

**Memory is bounded by the batch's bytes, not by its widest field.** A column's values
are converted from fixed-width byte strings, a matrix of (values) x (width). Made at the
widest value, one long field makes every row of the batch that wide (40 KB of 1,000 rows,
one with a 20 KB field, took 345 MB). So values are grouped by width: while the matrix at
the widest value holds at most ``_SLACK`` times the values' bytes it is made in one piece
(the common case: one conversion per column); otherwise each group holds the values of
lengths in ``[2**(k-1), 2**k)``, whose matrix is under twice their bytes. A matrix is cut
out of the buffer as rows of a window view (no index matrix), and a few wide values are
converted one by one (see ``_CAST_BUFFER``). Peak memory per batch is a small multiple of
its bytes whatever the field widths (``tests/test_stream_input.py`` measures it), and
``max_record_bytes`` bounds a line.

**Plain decimals skip numpy's string parsing.** Ids, counts and floats such as ``0.125``
are computed from their digit columns (:func:`_plain_decimals`), exactly as Python's
``int`` and ``float`` give them; anything else (signs, exponents, spaces) goes through
numpy's cast.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from persia_py.ids import hash_values
from persia_py.ids.routing import RESERVED_ID
from persia_py.input.readers import (
    BadRecordError,
    CsvBatch,
    CsvColumn,
    CsvReaderConfig,
    field_count_error,
    record_too_long,
)

_NEWLINE, _CR, _QUOTE = ord("\n"), ord("\r"), ord('"')
_SLACK = 4
"""A matrix of values at their widest may hold this many times their bytes (plus one
per value) before values are grouped by width."""
_CAST_BUFFER = 32
"""numpy's cast of fixed-width bytes to a number buffers this many values of the array's
width as UCS4 (128 bytes per byte of width) whatever their number: a group of fewer wider
than ``_NARROW`` bytes is converted value by value with Python's ``float`` or ``int``
(fewer than 32 calls per group, each on a string of at least 32 bytes)."""
_NARROW = 64
_POWERS_OF_TEN = 10.0 ** np.arange(17)  # exact as float64 up to 10**22
_INT64_MAX = np.uint64(2**63 - 1)
_WHITESPACE = np.zeros(256, bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")] = True
"""ASCII bytes that ``str.strip`` removes, as ``CsvReader`` strips a field."""


def parse_csv_lines(data: bytes, config: CsvReaderConfig, path: str, first_line: int) -> CsvBatch:
    """Every record of ``data`` (complete lines, each ending in a newline) as one batch,
    parsed with array operations over the whole buffer, no loop per row or field.

    ``first_line`` is the 1-based line number of ``data``'s first line (for errors and
    ``rows``). Blank lines are skipped. Fields are not quoted: a line with a quote
    character, longer than ``config.max_record_bytes``, with the wrong number of fields,
    or with a value that does not parse is a :class:`BadRecordError` naming ``path`` and
    the line (``skip_bad_rows`` is not honoured here: a stream cannot skip a row and still
    replay exactly)."""
    if len(config.id_separator) != 1:
        raise ValueError(f"id_separator: the streaming reader needs one character, got "
                         f"{config.id_separator!r}")
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size and buf[-1] != _NEWLINE:
        raise ValueError(f"{path}: parse_csv_lines takes complete lines (the data must end "
                         "with a newline)")
    newlines = np.flatnonzero(buf == _NEWLINE)
    starts = np.empty_like(newlines)
    starts[:1], starts[1:] = 0, newlines[:-1] + 1
    check_line_lengths(newlines - starts, config.max_record_bytes, path, first_line)
    ends = newlines - ((newlines > starts) & (buf[np.maximum(newlines - 1, 0)] == _CR))
    lines = first_line + np.arange(ends.size, dtype=np.int64)
    keep = ends > starts
    starts, ends, lines = starts[keep], ends[keep], lines[keep]
    quotes = np.flatnonzero(buf == _QUOTE)
    if quotes.size:
        row = int(first_line + np.searchsorted(newlines, quotes[0]))
        raise BadRecordError(path, row, "quoted fields are not supported by the streaming "
                                        "reader")
    field_starts, field_ends = _split_fields(buf, starts, ends, lines, config, path)
    # Rows of the window view may run past the buffer's end by up to the widest value.
    padded = np.concatenate([buf, np.zeros(int((ends - starts).max(initial=0)) + 1, np.uint8)])
    values, id_lists = {}, {}
    for k, column in enumerate(config.columns):  # a loop over columns, not rows
        s, e = field_starts[:, k], field_ends[:, k]
        if column.kind == "ids":
            id_lists[column.name] = _parse_id_lists(buf, padded, s, e, config, column, path,
                                                    lines)
        elif column.kind == "category":
            s, e = _strip(buf, s, e)
            salt = column.name if column.salt is None else column.salt
            ids = np.empty(s.size, np.uint64)
            for index, texts, _ in _text_groups(padded, s, e):
                ids[index] = hash_values(texts, salt=salt)
            id_lists[column.name] = (ids, np.ones(s.size, np.int32))
        elif column.kind != "skip":
            values[column.name] = _parse_numbers(buf, padded, s, e, column, path, lines)
    return CsvBatch(values=values, id_lists=id_lists, rows=lines)


def check_line_lengths(lengths: np.ndarray, limit: int, path: str, first_line: int) -> None:
    """A :class:`BadRecordError` for the first line longer than ``limit`` bytes (its
    newline not counted); ``lengths`` are those of consecutive lines from ``first_line``."""
    if not lengths.size or lengths.max() <= limit:
        return
    over = np.flatnonzero(lengths > limit)
    if over.size:
        raise BadRecordError(path, first_line + int(over[0]),
                             record_too_long(limit, int(lengths[over[0]])))


def _split_fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, lines: np.ndarray,
                  config: CsvReaderConfig, path: str) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of every field, ``[records, fields]`` each."""
    num_fields = len(config.columns)
    delims = np.flatnonzero(buf == ord(config.delimiter))
    delim_line = np.searchsorted(ends, delims)  # index (among kept lines) of each delimiter
    counts = np.bincount(delim_line, minlength=ends.size)[:ends.size] + 1
    bad = np.flatnonzero(counts != num_fields)
    if bad.size:
        raise BadRecordError(path, int(lines[bad[0]]),
                             field_count_error(int(counts[bad[0]]), config))
    inner = delims.reshape(ends.size, num_fields - 1)
    return (np.concatenate([starts[:, None], inner + 1], axis=1),
            np.concatenate([inner, ends[:, None]], axis=1))


def _text_groups(padded: np.ndarray, starts: np.ndarray, ends: np.ndarray
                 ) -> Iterator[tuple[slice | np.ndarray, np.ndarray, np.ndarray]]:
    """The byte strings ``padded[starts[i]:ends[i]]`` as fixed-width bytes arrays, in a
    few groups of similar widths: (which ``i``, ascending: all of them or an index array;
    the strings; their lengths). Together the groups' matrices hold at most ``_SLACK``
    times the strings' bytes plus one per string (see the module docstring)."""
    lengths = ends - starts
    if not lengths.size:
        return
    widest = int(lengths.max())
    if widest * lengths.size <= _SLACK * (int(lengths.sum()) + lengths.size):
        yield slice(None), _fixed_width(padded, starts, lengths, widest), lengths
        return
    bits = np.frexp(lengths.astype(np.float64))[1]  # the bit length: 0, 1, 2, 2, 3, ...
    order = np.argsort(bits, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(bits[order])) + 1):
        yield group, _fixed_width(padded, starts[group], lengths[group],
                                  int(lengths[group].max())), lengths[group]


def _fixed_width(padded: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 width: int) -> np.ndarray:
    """``padded[starts[i]:starts[i] + lengths[i]]`` as one ``S<width>`` array (``padded``
    has at least ``width`` bytes after every start)."""
    if width == 0:
        return np.zeros(starts.size, dtype="S1")
    windows = np.ndarray((padded.size - width + 1, width), np.uint8, padded, strides=(1, 1))
    cells = windows[starts]  # [n, width] bytes, one copy
    if starts.size < _CAST_BUFFER:  # a few (wide) values: no [width] array of offsets
        for row, length in zip(cells, lengths.tolist()):
            row[length:] = 0
    else:
        offsets = np.arange(width, dtype=np.min_scalar_type(width))
        np.multiply(cells, offsets < lengths[:, None], out=cells)  # zero the tails
    return cells.view(f"S{width}").reshape(-1)


def _to_numbers(padded: np.ndarray, starts: np.ndarray, ends: np.ndarray, dtype
                ) -> tuple[np.ndarray, tuple[int, Exception] | None]:
    """The byte strings as ``dtype``, and the index (in file order) and error of the first
    one that does not parse (None when all do)."""
    out = np.empty(starts.size, dtype)
    first_bad: tuple[int, Exception] | None = None
    for index, texts, lengths in _text_groups(padded, starts, ends):
        values = _cast(texts, lengths, dtype)
        if values is None:  # a few wide ones, or one that does not parse: value by value
            values = np.empty(texts.size, dtype)
            for j, text in enumerate(texts.tolist()):
                try:
                    values[j] = _one_number(text, dtype)
                except (ValueError, OverflowError) as exc:
                    i = int(np.arange(starts.size)[index][j])
                    if first_bad is None or i < first_bad[0]:
                        first_bad = (i, exc)
                    break
        if isinstance(index, slice):
            return values, first_bad
        out[index] = values
    return out, first_bad


def _cast(texts: np.ndarray, lengths: np.ndarray, dtype) -> np.ndarray | None:
    """The strings as ``dtype`` by array operations, or None: for a few wide strings
    (numpy's cast would buffer 128 times their width, see ``_CAST_BUFFER``), or when one
    does not parse."""
    if texts.size < _CAST_BUFFER and texts.dtype.itemsize > _NARROW:
        return None
    values = _plain_decimals(texts, lengths, dtype)
    if values is not None:
        return values
    try:
        return texts.astype(dtype)
    except (ValueError, OverflowError):
        return None


def _plain_decimals(texts: np.ndarray, lengths: np.ndarray, dtype) -> np.ndarray | None:
    """Strings of decimal digits alone (most ids and counts; for floats, with at most one
    ``.`` and 15 digits, as ``0.125``) as ``dtype``, by Horner's rule over the columns of
    their byte matrix: several times faster than numpy's cast from strings, which parses
    value by value. The same values: digits are exact integers, and a float is one exact
    integer divided by an exact power of ten, which IEEE division rounds correctly. None
    when a string is anything else (a sign, a space, an exponent, empty, too many
    digits): numpy's cast decides those."""
    width, is_float = texts.dtype.itemsize, dtype == np.float64
    if width > (16 if is_float else 19) or not lengths.all():  # 19 digits fit a uint64
        return None
    raw = texts.view(np.uint8).reshape(texts.size, width)
    digits = raw - np.uint8(ord("0"))
    is_digit = digits <= 9  # the zero padding after a string is not (0 - 48 wraps to 208)
    # Whole-matrix checks (a sum per row is slow for short rows): every byte a digit, a
    # point or padding, and exactly as many padding bytes as the lengths leave.
    padding = raw == 0
    points = raw == ord(".") if is_float else np.zeros_like(padding)
    if (not (is_digit | padding | points).all()
            or np.count_nonzero(padding) != raw.size - int(lengths.sum())):
        return None
    if is_float:
        point_rows, point_columns = np.nonzero(points)
        if point_rows.size and ((np.diff(point_rows) == 0).any()  # two points in a value
                                or (lengths[point_rows] < 2).any()):  # "." alone
            return None
        if int(lengths.max()) - (point_rows.size == texts.size) > 15:
            has_point = np.zeros(texts.size, bool)
            has_point[point_rows] = True
            if (lengths - has_point).max() > 15:  # 15 digits: exact in a float64
                return None
        after_point = np.zeros(texts.size, np.int64)
        after_point[point_rows] = lengths[point_rows] - 1 - point_columns
    values = np.zeros(texts.size, np.uint64)
    for column, valid in zip(digits.T, is_digit.T):
        values = np.where(valid, values * np.uint64(10) + column, values)
    if is_float:
        return values.astype(np.float64) / _POWERS_OF_TEN[after_point]
    if dtype == np.int64 and (values > _INT64_MAX).any():
        return None
    return values.astype(dtype, copy=False)


def _one_number(text: bytes, dtype) -> int | float:
    """One byte string as ``dtype``: by numpy's cast if it is narrow, else by Python's own
    ``float`` or ``int`` (whose memory is that of the string; see ``_CAST_BUFFER``)."""
    if len(text) <= _NARROW:
        return np.array([text]).astype(dtype)[0]
    if dtype == np.float64:
        return float(text)
    value = int(text)
    low, high = (-(2**63), 2**63) if dtype == np.int64 else (0, 2**64)
    if not low <= value < high:
        raise OverflowError(f"out of the {np.dtype(dtype).name} range")
    return value


def _parse_numbers(buf: np.ndarray, padded: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                   column: CsvColumn, path: str, lines: np.ndarray) -> np.ndarray:
    """A ``float`` (float32) or ``int`` (int64) column; an empty field takes the column's
    ``default`` if it has one. On a bad value, the error names its line."""
    todo: slice | np.ndarray = slice(None)
    if column.default is not None:
        trimmed_starts, trimmed_ends = _strip(buf, starts, ends)
        empty = trimmed_ends == trimmed_starts
        todo = np.flatnonzero(~empty)
    parsed, bad = _to_numbers(padded, starts[todo], ends[todo],
                              np.float64 if column.kind == "float" else np.int64)
    if bad is None and column.kind == "float":
        with np.errstate(over="ignore"):
            parsed = parsed.astype(np.float32)  # beyond float32's range: inf, refused below
        finite = np.isfinite(parsed)
        if not finite.all():
            bad = (int(np.argmin(finite)), ValueError("not a finite float32"))
    if bad is not None:
        i, exc = np.arange(starts.size)[todo][bad[0]], bad[1]
        text = bytes(buf[starts[i]:min(ends[i], starts[i] + 40)]).decode(errors="replace")
        raise BadRecordError(path, int(lines[i]), f"column {column.name!r}: {text!r} is not "
                             f"a valid {column.kind} ({exc})")
    if isinstance(todo, slice):
        return parsed
    out = np.full(starts.size, column.default, parsed.dtype)
    out[todo] = parsed
    return out


def _strip(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """The fields without their leading and trailing ASCII whitespace."""
    solid = np.flatnonzero(~_WHITESPACE[buf])
    first = np.searchsorted(solid, starts)  # the first non-space byte at or after a start
    last = np.searchsorted(solid, ends) - 1  # the last one before an end
    new_starts = np.where(first < solid.size, solid[np.minimum(first, solid.size - 1)], ends)
    new_ends = np.where(last >= 0, solid[np.maximum(last, 0)] + 1, starts)
    empty = new_starts >= new_ends
    return np.where(empty, starts, new_starts), np.where(empty, starts, new_ends)


def _parse_id_lists(buf: np.ndarray, padded: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    config: CsvReaderConfig, column: CsvColumn, path: str,
                    lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One ``ids`` column: (uint64 ids, int32 per-record lengths); empty tokens skipped."""
    seps = np.flatnonzero(buf == ord(config.id_separator))
    field = np.searchsorted(ends, seps)  # the record whose field may hold each separator
    field = np.minimum(field, max(ends.size - 1, 0))
    inside = (ends.size > 0) & (seps >= starts[field]) & (seps < ends[field])
    seps = seps[inside]
    token_starts = np.sort(np.concatenate([starts, seps + 1]))
    token_ends = np.sort(np.concatenate([seps, ends]))
    nonempty = token_ends > token_starts
    token_starts, token_ends = token_starts[nonempty], token_ends[nonempty]
    record = np.searchsorted(ends, token_starts)
    lengths = np.bincount(record, minlength=ends.size).astype(np.int32)
    ids, bad = _to_numbers(padded, token_starts, token_ends, np.uint64)
    reason = "" if bad is None else f" ({bad[1]})"
    first_bad = None if bad is None else bad[0]
    if first_bad is None and (ids >= RESERVED_ID).any():
        first_bad = int(np.argmax(ids >= RESERVED_ID))
    if first_bad is not None:
        i = first_bad
        text = bytes(buf[token_starts[i]:min(token_ends[i], token_starts[i] + 40)])
        raise BadRecordError(path, int(lines[record[i]]), f"column {column.name!r}: "
                             f"{text.decode(errors='replace')!r} is not a valid id (ids must "
                             f"be in [0, {int(RESERVED_ID)})){reason}")
    return ids, lengths
