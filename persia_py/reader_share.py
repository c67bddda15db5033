"""Which part of an input file a data loader reads, by loader index (implemented in
:mod:`persia_py.input.reader_share`)."""

from persia_py.input.reader_share import ReaderShare

__all__ = ["ReaderShare"]
