"""Readers of a growing, time-ordered input for online training: a stream of record
batches that never ends (implemented in :mod:`persia_py.input.stream_reader`)."""

from persia_py.input.stream_reader import (
    CsvFormat,
    ParquetFormat,
    StreamBatch,
    StreamPosition,
    StreamReader,
)

__all__ = ["CsvFormat", "ParquetFormat", "StreamBatch", "StreamPosition", "StreamReader"]
