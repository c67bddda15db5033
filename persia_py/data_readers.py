"""Readers for data-loader scripts: CSV records into column arrays, malformed rows
reported with file and line (implemented in :mod:`persia_py.input.readers`)."""

from persia_py.input.readers import (
    BadRecordError,
    CsvBatch,
    CsvColumn,
    CsvReader,
    CsvReaderConfig,
)

__all__ = ["BadRecordError", "CsvBatch", "CsvColumn", "CsvReader", "CsvReaderConfig"]
