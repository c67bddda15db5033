"""CSV reader: columns parsed into arrays; a malformed record names its file and row, or is
skipped and counted when asked."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from persia_py.input.readers import BadRecordError, CsvColumn, CsvReader, CsvReaderConfig

COLUMNS = (CsvColumn(name="label", kind="float"), CsvColumn(name="count", kind="int"),
           CsvColumn(name="comment", kind="skip"), CsvColumn(name="tags", kind="ids"))
GOOD = 'label,count,comment,tags\n1,3,"a, quoted",5 6 7\n0,-2,x,\n0.5,9,y,8\n'
BAD_LINES = [
    "1,2,x",                      # too few fields
    "1,2,x,5,6",                  # too many
    "one,2,x,5",                  # not a float
    "nan,2,x,5",                  # not finite
    "1,2.5,x,5",                  # not an int
    "1,2,x,5 -1",                 # negative id
    "1,2,x,18446744073709551615",  # the reserved id
]


def _config(**kwargs) -> CsvReaderConfig:
    return CsvReaderConfig(columns=COLUMNS, header=True, **kwargs)


def test_reads_columns_in_batches(tmp_path) -> None:
    path = tmp_path / "good.csv"
    path.write_text(GOOD)
    batches = list(CsvReader(path, _config()).batches(batch_size=2))
    assert [b.num_records for b in batches] == [2, 1]
    first = batches[0]
    np.testing.assert_array_equal(first.values["label"], np.array([1, 0], np.float32))
    assert first.values["count"].dtype == np.int64 and list(first.values["count"]) == [3, -2]
    ids, lengths = first.id_lists["tags"]
    assert ids.dtype == np.uint64 and list(ids) == [5, 6, 7] and list(lengths) == [3, 0]
    assert "comment" not in first.values and list(first.rows) == [2, 3]


@pytest.mark.parametrize("line", BAD_LINES)
def test_a_bad_record_names_file_and_row(tmp_path, line: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(GOOD + line + "\n1,1,z,1\n")
    with pytest.raises(BadRecordError) as info:
        CsvReader(path, _config()).read_all()
    assert info.value.path == str(path) and info.value.row == 5
    assert str(info.value).startswith(f"{path}: row 5: ")


def test_skip_bad_rows_counts_and_reports_them(tmp_path, caplog) -> None:
    path = tmp_path / "mixed.csv"
    path.write_text(GOOD + "\n".join(f"{line}\n1,{i},z,{i}" for i, line in enumerate(BAD_LINES))
                    + "\n")
    reader = CsvReader(path, _config(skip_bad_rows=True))
    with caplog.at_level(logging.WARNING, logger="persia_py.input.readers"):
        batch = reader.read_all()
    assert batch.num_records == 3 + len(BAD_LINES)
    assert reader.num_bad_rows == len(BAD_LINES) and reader.num_rows == 3 + 2 * len(BAD_LINES)
    assert reader.first_bad.row == 5
    assert f"skipped {len(BAD_LINES)} malformed rows" in caplog.text and str(path) in caplog.text


def test_an_unterminated_quote_is_reported(tmp_path) -> None:
    path = tmp_path / "quote.csv"
    path.write_text(GOOD + '1,2,"unterminated,5\n')
    with pytest.raises(BadRecordError, match="row 5: not valid CSV"):
        CsvReader(path, _config()).read_all()


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kind 'text'"):
        CsvColumn(name="a", kind="text")
    with pytest.raises(ValueError, match="unique"):
        CsvReaderConfig(columns=(CsvColumn(name="a", kind="int"), CsvColumn(name="a", kind="int")))
    with pytest.raises(ValueError, match="id_separator"):
        CsvReaderConfig(columns=COLUMNS, id_separator=",")
