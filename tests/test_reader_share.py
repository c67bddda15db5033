"""A data loader reads only its share of a CSV file, by its index, with no code of the
user's: the shares of every loader count cover every record exactly once, rows keep the
file's line numbers, and a record that cannot be cut between loaders is refused."""

from __future__ import annotations

import numpy as np
import pytest

from persia_py.env import ENV_DATA_LOADER_REPLICA_INDEX, ENV_DATA_LOADER_REPLICA_SIZE, PersiaEnv
from persia_py.input.reader_share import ReaderShare
from persia_py.input.readers import BadRecordError, CsvColumn, CsvReader, CsvReaderConfig

CONFIG = CsvReaderConfig(columns=(CsvColumn(name="row", kind="int"),
                                  CsvColumn(name="cat", kind="category"),
                                  CsvColumn(name="x", kind="float", default=-1.0)),
                         delimiter="\t", header=True)


def _write(path, num_rows: int, *, seed: int = 0, newline: str = "\n",
           trailing_newline: bool = True) -> None:
    rng = np.random.default_rng(seed)
    lines = ["row\tcat\tx"]
    for r in range(num_rows):  # rows of very different lengths, so cuts land anywhere
        cat = format(int(rng.integers(0, 2**32)), "x") * int(rng.integers(0, 6))
        lines.append(f"{r}\t{cat}\t{'' if r % 7 == 0 else r / 2}")
    path.write_text(newline.join(lines) + (newline if trailing_newline else ""))


@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 333])
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shares_cover_every_record_exactly_once(tmp_path, num_rows: int, count: int) -> None:
    path = tmp_path / "data.tsv"
    _write(path, num_rows, seed=num_rows * 10 + count)
    seen, lines = [], []
    for index in range(count):
        batch = CsvReader(path, CONFIG, share=ReaderShare(index, count)).read_all()
        seen.append(batch.values["row"])
        lines.append(batch.rows)
    rows = np.concatenate(seen)
    assert sorted(rows.tolist()) == list(range(num_rows))
    # Shares are contiguous and in file order; line numbers are the file's (header = 1).
    np.testing.assert_array_equal(rows, np.arange(num_rows))
    np.testing.assert_array_equal(np.concatenate(lines), np.arange(num_rows) + 2)


def test_shares_are_even_and_values_match_a_whole_read(tmp_path) -> None:
    path = tmp_path / "data.tsv"
    _write(path, 2000, newline="\r\n", trailing_newline=False)
    whole = CsvReader(path, CONFIG, share=ReaderShare.whole()).read_all()
    parts = [CsvReader(path, CONFIG, share=ReaderShare(i, 4)).read_all() for i in range(4)]
    assert all(abs(p.num_records - 500) < 60 for p in parts), [p.num_records for p in parts]
    for key in ("row", "x"):
        np.testing.assert_array_equal(np.concatenate([p.values[key] for p in parts]),
                                      whole.values[key])
    np.testing.assert_array_equal(np.concatenate([p.id_lists["cat"][0] for p in parts]),
                                  whole.id_lists["cat"][0])
    assert whole.values["x"][0] == -1.0  # an empty field took the column's default


def test_default_share_is_the_data_loaders_own(tmp_path, monkeypatch) -> None:
    path = tmp_path / "data.tsv"
    _write(path, 100)
    assert ReaderShare.of_this_process(PersiaEnv.from_environ({})) == ReaderShare.whole()
    got = []
    for index in range(3):
        monkeypatch.setenv(ENV_DATA_LOADER_REPLICA_INDEX, str(index))
        monkeypatch.setenv(ENV_DATA_LOADER_REPLICA_SIZE, "3")
        reader = CsvReader(path, CONFIG)
        assert reader.share == ReaderShare(index, 3)
        got.append(reader.read_all().values["row"])
    assert sorted(np.concatenate(got).tolist()) == list(range(100))
    assert all(0 < g.size < 100 for g in got)


def test_a_record_spanning_lines_is_refused_when_shared(tmp_path) -> None:
    config = CsvReaderConfig(columns=(CsvColumn(name="a", kind="int"),
                                      CsvColumn(name="note", kind="skip")))
    path = tmp_path / "quoted.csv"
    path.write_text('1,"one line"\n2,"two\nlines"\n3,x\n')
    assert CsvReader(path, config, share=ReaderShare.whole()).read_all().values["a"].tolist() \
        == [1, 2, 3]
    # Cut inside the quoted field: the first loader's share ends in it, the second
    # begins in it; each names the cause instead of reading half a record.
    for index in range(2):
        with pytest.raises(BadRecordError, match=r"a record spanning lines cannot be shared "
                                                 rf"between data loaders \(share {index} of 2\)"):
            CsvReader(path, config, share=ReaderShare(index, 2)).read_all()
    # Cut after it: the loader that reads it whole still refuses it.
    path.write_text('1,"two\nlines"\n' + "2,xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n")
    with pytest.raises(BadRecordError, match=r"row 2: a record of 2 lines; a record spanning "
                                             r"lines cannot be shared"):
        CsvReader(path, config, share=ReaderShare(0, 2)).read_all()


def test_bad_shares_and_columns_are_refused() -> None:
    with pytest.raises(ValueError, match=r"ReaderShare.index: expected an int in \[0, 2\)"):
        ReaderShare(2, 2)
    with pytest.raises(ValueError, match=r"ReaderShare.count: expected an int >= 1"):
        ReaderShare(0, 0)
    with pytest.raises(ValueError, match="default is for 'float' and 'int' columns"):
        CsvColumn(name="c", kind="category", default=0)
    with pytest.raises(ValueError, match="salt is for 'category' columns"):
        CsvColumn(name="c", kind="int", salt="x")
