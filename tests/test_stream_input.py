"""Bounded input at the stream's seam: what a producer writes cannot take the loader's
memory or make it read outside its folder.

* A batch with one very long (valid) field is parsed in memory bounded by a small
  multiple of the batch's bytes (tracemalloc's peak), with the same values as
  ``CsvReader``.
* A line over ``max_record_bytes`` is an error naming the file and line, in the stream
  (complete or still being written) and in ``CsvReader`` (or skipped and counted there).
* Symbolic links in a followed folder are refused, never read: a link to a file or a
  folder among the stream's names, a file swapped for a link after it was listed, and
  position names that point outside the folder.
* The streaming parser honours every column option as ``CsvReader`` does (``default``,
  ``category``, ``salt``, a float32's range).
* With ``header=True`` a file's first line must be the header naming the columns.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from persia_py.input.reader_share import ReaderShare
from persia_py.input.readers import BadRecordError, CsvColumn, CsvReader, CsvReaderConfig
from persia_py.input.stream_reader import CsvFormat, StreamPosition, StreamReader

COLUMNS = (CsvColumn(name="sid", kind="int"), CsvColumn(name="x", kind="float"),
           CsvColumn(name="tags", kind="ids"), CsvColumn(name="city", kind="skip"))
WITH_CATEGORY = (*COLUMNS[:3], CsvColumn(name="city", kind="category"))


def _reader(path: Path, pattern: str = "*", **config) -> StreamReader:
    config.setdefault("columns", COLUMNS)
    return StreamReader(path, CsvFormat(CsvReaderConfig(**config)), pattern=pattern,
                        poll_interval_sec=0.01, max_wait_sec=0.05, idle_timeout_sec=0.3)


def _rows(count: int) -> list[str]:
    return [f"{i},{i / 7:.4f},{i} {i + 1} {i + 2},c{i % 13}\n" for i in range(count)]


@pytest.mark.parametrize("category", [False, True])
def test_a_long_valid_field_is_parsed_in_memory_bounded_by_the_batch(
        tmp_path: Path, category: bool) -> None:
    columns = WITH_CATEGORY if category else COLUMNS
    width = 20_000
    rows = _rows(600)
    rows[3] = "3,0.5" + "0" * width + ",1 2,c3\n"          # a long float
    rows[7] = "7,1.0," + "0" * 4000 + "9 10,c7\n"           # a long id (4,001 digits)
    rows[9] = "9,2.0,5," + "x" * width + "\n"               # a long category (or skipped)
    rows[11] = "11,3.0," + " ".join(map(str, range(3000))) + ",c11\n"  # many ids
    (tmp_path / "a.csv").write_text("".join(rows))
    size = (tmp_path / "a.csv").stat().st_size
    reader = _reader(tmp_path, columns=columns)
    start, end = StreamPosition("a.csv"), StreamPosition("a.csv", size, len(rows))
    reader.read(start, end)  # once first: lazy imports and compiled kernels load
    tracemalloc.start()
    try:
        batch = reader.read(start, end)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Values at the widest field's width for every row took ~5,000 times the bytes.
    assert peak < 24 * size, f"parsing {size} bytes took {peak} bytes at the peak"
    records = batch.records
    assert records.num_records == 600 and records.values["x"][3] == np.float32(0.5)
    ids, lengths = records.id_lists["tags"]
    assert lengths[7] == 2 and lengths[11] == 3000
    assert ids[lengths[:7].sum()] == 9 and ids[lengths[:11].sum() + 2999] == 2999
    expected = CsvReader(tmp_path / "a.csv", CsvReaderConfig(columns=columns),
                         share=ReaderShare.whole()).read_all()
    for name in ("sid", "x"):
        np.testing.assert_array_equal(records.values[name], expected.values[name])
    for name in ("tags", "city") if category else ("tags",):
        for mine, theirs in zip(records.id_lists[name], expected.id_lists[name]):
            np.testing.assert_array_equal(mine, theirs)


def test_a_line_over_max_record_bytes_names_file_and_line(tmp_path: Path) -> None:
    rows = _rows(6)
    rows[2] = "2,0.5," + " ".join(["7"] * 61) + ",c2\n"  # 130 bytes and its newline
    (tmp_path / "a.csv").write_text("".join(rows))
    message = r"a\.csv: row 3: a line of 130 bytes, over max_record_bytes \(100\)"
    with pytest.raises(BadRecordError, match=message):
        list(_reader(tmp_path, max_record_bytes=100).batches(4))
    with pytest.raises(BadRecordError, match=message):  # a range read again, as after a restart
        _reader(tmp_path, max_record_bytes=100).read(
            StreamPosition("a.csv", 0, 0), StreamPosition("a.csv", len("".join(rows[:4])), 4))
    assert _reader(tmp_path, max_record_bytes=130).read(  # the limit itself is allowed
        StreamPosition("a.csv", 0, 0), StreamPosition("a.csv", len("".join(rows[:4])), 4)
    ).num_records == 4
    growing = tmp_path / "growing"
    growing.mkdir()
    (growing / "b.csv").write_text("".join(rows[:2]) + "2,0.5," + "7 " * 200)  # not ended yet
    with pytest.raises(BadRecordError, match=r"b\.csv: row 3: a line of more than 100 bytes"):
        list(_reader(growing, max_record_bytes=100).batches(4))  # no wait for its newline


def test_scans_across_read_chunks_keep_exact_batches_and_limits(tmp_path: Path) -> None:
    """A scan reads 64 KiB, then twice as much each time: batches and line limits across
    those reads are exact."""
    rows = _rows(10_000)  # ~300 KB; a batch of 4,000 rows spans three reads
    (tmp_path / "a.csv").write_text("".join(rows))
    batches = list(_reader(tmp_path).batches(4000))
    assert [b.num_records for b in batches] == [4000, 4000, 2000]
    assert np.concatenate([b.records.values["sid"] for b in batches]).tolist() == list(
        range(10_000))
    assert batches[1].start.offset == len("".join(rows[:4000]))
    assert batches[1].end == StreamPosition("a.csv", len("".join(rows[:8000])), 8000)
    rows[5000] = "5000,0.5," + "1 " * 50_000 + ",c\n"  # 100,011 bytes from byte ~150 KB
    (tmp_path / "a.csv").write_text("".join(rows))
    with pytest.raises(BadRecordError, match=r"row 5001: a line of 100011 bytes, over"):
        list(_reader(tmp_path, max_record_bytes=80_000).batches(8000))


def test_csv_reader_honours_max_record_bytes(tmp_path: Path) -> None:
    rows = _rows(5)
    rows[1] = "1,0.5," + "7 " * 100 + ",c1\n"
    path = tmp_path / "a.csv"
    path.write_text("".join(rows))
    config = dict(columns=COLUMNS, max_record_bytes=64)
    with pytest.raises(BadRecordError, match=r"a\.csv: row 2: a line of more than 64 bytes"):
        CsvReader(path, CsvReaderConfig(**config), share=ReaderShare.whole()).read_all()
    reader = CsvReader(path, CsvReaderConfig(**config, skip_bad_rows=True),
                       share=ReaderShare.whole())
    batch = reader.read_all()
    assert batch.rows.tolist() == [1, 3, 4, 5] and reader.num_bad_rows == 1
    assert reader.num_rows == 5 and reader.first_bad.row == 2


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1024"])
def test_max_record_bytes_is_checked(value) -> None:
    with pytest.raises(ValueError, match="max_record_bytes must be an int >= 1"):
        CsvReaderConfig(columns=COLUMNS, max_record_bytes=value)


# -- links ----------------------------------------------------------------------------------

def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.txt"
    secret.write_text("topsecret,1,2,3\n")
    return secret


@pytest.mark.parametrize("target", ["file", "folder"])
def test_a_link_in_a_stream_folder_is_refused_not_read(tmp_path: Path, target: str) -> None:
    folder = tmp_path / "stream"
    folder.mkdir()
    (folder / "000.csv").write_text("".join(_rows(3)))
    secret = _secret(tmp_path)
    os.symlink(secret if target == "file" else tmp_path, folder / "001.csv")
    os.symlink(secret, folder / ".hidden.csv")  # not a stream name: ignored like any other
    os.symlink(secret, folder / "notes.txt")
    with pytest.raises(ValueError, match="'001.csv' is a symbolic link") as info:
        list(_reader(folder, pattern="*.csv").batches(10))
    assert "topsecret" not in str(info.value)


def test_a_file_replaced_by_a_link_is_not_opened(tmp_path: Path) -> None:
    folder = tmp_path / "stream"
    folder.mkdir()
    path = folder / "000.csv"
    path.write_text("".join(_rows(3)))
    reader = _reader(folder)
    batch = next(reader.batches(10))
    swapped = _secret(tmp_path)
    swapped.write_bytes(path.read_bytes().replace(b"0,0.0000", b"9,9.9999"))
    path.unlink()
    os.symlink(swapped, path)  # after the listing: only O_NOFOLLOW stops it
    with pytest.raises(ValueError, match="'000.csv' is a symbolic link"):
        reader.read(batch.start, batch.end)


@pytest.mark.parametrize("name", ["../secret.txt", "sub/000.csv", ".hidden.csv", ".."])
def test_a_position_outside_the_stream_is_refused(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "stream"
    folder.mkdir()
    (folder / "000.csv").write_text("".join(_rows(3)))
    _secret(tmp_path)
    with pytest.raises(ValueError, match="not a file of this stream"):
        _reader(folder, pattern="*.csv").read(StreamPosition(name), StreamPosition(name, 16, 1))


def test_a_parquet_file_is_not_opened_through_a_link(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")  # in the test extra; the skip only names a bare install
    import pyarrow.parquet as pq

    from persia_py.input.stream_reader import ParquetFormat

    pq.write_table(pa.table({"sid": pa.array([1, 2], pa.int64())}), tmp_path / "real.parquet")
    folder = tmp_path / "stream"
    folder.mkdir()
    os.symlink(tmp_path / "real.parquet", folder / "a.parquet")
    reader = StreamReader(folder, ParquetFormat((CsvColumn(name="sid", kind="int"),)),
                          idle_timeout_sec=0.3)
    with pytest.raises(ValueError, match="'a.parquet' is a symbolic link"):
        list(reader.batches(4))
    with pytest.raises(ValueError, match="'a.parquet' is a symbolic link"):
        reader.read(StreamPosition("a.parquet"), StreamPosition("a.parquet", 0, 2))


def test_a_followed_file_given_as_a_link_is_resolved_once(tmp_path: Path) -> None:
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    first.write_text("".join(_rows(3)))
    second.write_text("".join(_rows(5)))
    link = tmp_path / "current.csv"
    os.symlink(first, link)
    reader = _reader(link)
    link.unlink()
    os.symlink(second, link)  # re-pointed: the reader keeps the file it was given
    assert sum(b.num_records for b in reader.batches(10)) == 3


def test_the_end_of_a_stream_sends_the_lines_still_waiting(tmp_path: Path) -> None:
    """``idle_timeout_sec`` ends the stream; complete lines that were waiting for
    ``max_wait_sec`` (a short batch) go out first instead of being left unread."""
    (tmp_path / "a.csv").write_text("".join(_rows(3)))  # the newest file: it may grow
    reader = StreamReader(tmp_path, CsvFormat(CsvReaderConfig(columns=COLUMNS)),
                          poll_interval_sec=0.01, max_wait_sec=600, idle_timeout_sec=0.05)
    assert [b.num_records for b in reader.batches(10)] == [3]


# -- every column option, as CsvReader ------------------------------------------------------

def test_stream_columns_match_csv_reader(tmp_path: Path) -> None:
    columns = (CsvColumn(name="count", kind="int", default=-1),
               CsvColumn(name="x", kind="float", default=0.5),
               CsvColumn(name="city", kind="category"),
               CsvColumn(name="town", kind="category", salt="city"),
               CsvColumn(name="note", kind="skip"),
               CsvColumn(name="tags", kind="ids"))
    text = ("3,1.5,paris,paris,a,1 2\n,,  lyon ,lyon,b,\n  ,  ,,,c,  7  8 \n"
            "12,2e-3,rome,x,d,9\r\n")
    (tmp_path / "a.csv").write_text(text)
    config = CsvReaderConfig(columns=columns, delimiter=",", id_separator=" ")
    mine = list(_reader(tmp_path, columns=columns).batches(10))[0].records
    theirs = CsvReader(tmp_path / "a.csv", config, share=ReaderShare.whole()).read_all()
    assert mine.values["count"].tolist() == [3, -1, -1, 12]
    for name in ("count", "x"):
        np.testing.assert_array_equal(mine.values[name], theirs.values[name])
    for name in ("city", "town", "tags"):
        for a, b in zip(mine.id_lists[name], theirs.id_lists[name]):
            np.testing.assert_array_equal(a, b)
    city, town = mine.id_lists["city"][0], mine.id_lists["town"][0]
    assert city[0] == town[0] and city[1] == town[1]  # one salt: one id per value


def test_a_float_beyond_float32_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("1,1e38,1,c\n2,1e39,2,c\n")
    with pytest.raises(BadRecordError, match=r"a\.csv: row 2: column 'x': '1e39'"):
        list(_reader(tmp_path).batches(10))
    with pytest.raises(BadRecordError, match=r"row 2: column 'x': '1e39'"):
        CsvReader(tmp_path / "a.csv", CsvReaderConfig(columns=COLUMNS),
                  share=ReaderShare.whole()).read_all()


def test_an_int_default_must_be_a_whole_number() -> None:
    with pytest.raises(ValueError, match="whole number"):
        CsvColumn(name="n", kind="int", default=0.5)


def test_numbers_parse_as_csv_reader_parses_them(tmp_path: Path, monkeypatch) -> None:
    """The array parser's shortcut for plain decimals (and numpy's cast for the rest)
    gives exactly the values of ``CsvReader`` (Python's ``int`` and ``float``)."""
    from persia_py.input import csv_parse

    shortcuts = []
    plain_decimals = csv_parse._plain_decimals
    monkeypatch.setattr(csv_parse, "_plain_decimals", lambda *args: shortcuts.append(
        plain_decimals(*args)) or shortcuts[-1])
    rng = np.random.default_rng(7)
    count = 4000
    digits = rng.integers(0, 10, (count, 22)).astype(str)
    cut = rng.integers(1, 22, count)
    plain = ["".join(row[:n]).lstrip("0")[:19] or "0" for row, n in zip(digits, cut)]
    forms = [lambda t: t[:15], lambda t: t[:14] + "." + t[14:15], lambda t: "." + t[:15],
             lambda t: t[:8] + "." + t[8:15], lambda t: "00" + t[:10] + ".",
             lambda t: "-" + t[:15], lambda t: t[:6] + "e-3", lambda t: " " + t[:12] + " ",
             lambda t: "+" + t[:5], lambda t: t]
    # The first half plain (the shortcut's), the second with signs, exponents, spaces.
    form = np.r_[rng.integers(0, 5, count // 2), rng.integers(0, len(forms), count // 2)]
    floats = [forms[k](t) for k, t in zip(form, plain)]
    ints = [t[:18] if k or i < count // 2 else "-" + t[:18]
            for i, (k, t) in enumerate(zip(rng.integers(0, 4, count), plain))]
    ids = [" ".join(plain[i:i + 3]) for i in range(count)]
    (tmp_path / "a.csv").write_text("".join(
        f"{i},{x},{t},c\n" for i, x, t in zip(ints, floats, ids)))
    columns = (CsvColumn(name="n", kind="int"), CsvColumn(name="x", kind="float"),
               CsvColumn(name="tags", kind="ids"), CsvColumn(name="c", kind="skip"))
    batches = list(_reader(tmp_path, columns=columns).batches(count // 4))
    theirs = CsvReader(tmp_path / "a.csv", CsvReaderConfig(columns=columns),
                       share=ReaderShare.whole()).read_all()
    for name in ("n", "x"):
        mine = np.concatenate([b.records.values[name] for b in batches])
        assert mine.dtype == theirs.values[name].dtype
        np.testing.assert_array_equal(mine, theirs.values[name])
    exact = np.array([float(x) for x in floats]).astype(np.float32)  # via float64 as Python
    assert (np.concatenate([b.records.values["x"] for b in batches]) == exact).all()
    ids = np.concatenate([b.records.id_lists["tags"][0] for b in batches])
    np.testing.assert_array_equal(ids, theirs.id_lists["tags"][0])
    assert sum(v is not None for v in shortcuts) >= 6  # each column took the shortcut
    assert sum(v is None for v in shortcuts) >= 2  # and numpy's cast


def test_parquet_refuses_the_options_it_cannot_honour() -> None:
    from persia_py.input.stream_reader import ParquetFormat

    for column in (CsvColumn(name="city", kind="category"),
                   CsvColumn(name="n", kind="int", default=0)):
        with pytest.raises(ValueError, match=f"column '{column.name}': Parquet columns take no"):
            ParquetFormat((column,))


@pytest.mark.parametrize("kind, texts", [
    ("float", ["1234567890123456", "5.", ".5", "0.000000000000001", "999999999999999.",
               "123456789012345", "0", "00000000000000.5"]),
    ("int", ["9223372036854775807", "0", "18", "0000000000000000001"]),
    ("ids", ["18446744073709551614", "1111111111111111111", "0", "42"]),
])
def test_plain_decimals_at_their_limits_parse_as_python_does(kind: str, texts: list) -> None:
    from persia_py.input.csv_parse import parse_csv_lines

    config = CsvReaderConfig(columns=(CsvColumn(name="v", kind=kind),))
    for cut in range(len(texts)):  # each value alone (one matrix width) and all together
        chunk = texts[cut:cut + 1] if cut else texts
        batch = parse_csv_lines("".join(t + "\n" for t in chunk).encode(), config, "a", 1)
        got = batch.id_lists["v"][0] if kind == "ids" else batch.values["v"]
        expected = ([np.float32(float(t)) for t in chunk] if kind == "float"
                    else [int(t) for t in chunk])
        assert got.tolist() == expected, chunk


@pytest.mark.parametrize("kind, text", [("float", "."), ("float", "1.2.3"), ("int", "1 2"),
                                        ("int", "9223372036854775808"), ("ids", "1.5")])
def test_not_quite_plain_decimals_are_errors(tmp_path: Path, kind: str, text: str) -> None:
    from persia_py.input.csv_parse import parse_csv_lines

    config = CsvReaderConfig(columns=(CsvColumn(name="v", kind=kind),), id_separator=";")
    with pytest.raises(BadRecordError, match=r"a: row 2: column 'v'"):
        parse_csv_lines(f"1\n{text}\n".encode(), config, "a", 1)


@pytest.mark.parametrize("first_line", [
    "0,0.5,1 2,paris",  # a record: the file has no header
    "sid,x,tags",  # a column missing
    "sid,y,tags,city",  # a column named otherwise
])
def test_a_first_line_that_is_not_the_header_is_an_error(tmp_path: Path, first_line) -> None:
    """With ``header=True`` every file's first line is checked before it is skipped, in
    the stream and in ``CsvReader``: a file without one would lose its first record."""
    stream = tmp_path / "stream"
    stream.mkdir()
    (stream / "000.csv").write_text("sid,x,tags,town\n" + "".join(_rows(3)))
    (stream / "001.csv").write_text(first_line + "\n" + "".join(_rows(3)))
    reader = _reader(stream, "*.csv", header=True).batches(10)
    assert next(reader).records.num_records == 3  # 'city' is skipped: any name will do
    expected = rf"{stream / '001.csv'}: row 1: .*CsvReaderConfig\(header=True\), but the first"
    with pytest.raises(BadRecordError, match=expected):
        next(reader)
    config = CsvReaderConfig(columns=COLUMNS, header=True, skip_bad_rows=True)
    assert CsvReader(stream / "000.csv", config).read_all().num_records == 3
    with pytest.raises(BadRecordError, match=expected):  # never skipped as a bad row
        CsvReader(stream / "001.csv", config).read_all()
