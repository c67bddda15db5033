"""Readers for data-loader scripts: CSV records into column arrays, malformed rows
reported with file and line (implemented in :mod:`persia_py.input.readers`), and the share
of a file each data loader reads (:class:`ReaderShare`, also in
:mod:`persia_py.reader_share`)."""

from persia_py.input.reader_share import ReaderShare
from persia_py.input.readers import (
    BadRecordError,
    CsvBatch,
    CsvColumn,
    CsvReader,
    CsvReaderConfig,
)

__all__ = ["BadRecordError", "CsvBatch", "CsvColumn", "CsvReader", "CsvReaderConfig",
           "ReaderShare"]
