"""PERSIA's ``persia.logger.get_default_logger``: a logger that prints without setup."""

from __future__ import annotations

import logging
import os

__all__ = ["get_default_logger"]

DEFAULT_LOGGER_NAME = "persia_py"
FORMAT = "%(asctime)s %(levelname)-8s [%(filename)s:%(lineno)d] %(message)s"


class _PersiaHandler(logging.StreamHandler):
    """The stderr handler this module adds; marked so that it is added once."""


def get_default_logger(name: str | None = None, *, log_level: int = logging.INFO,
                       log_filename: str | None = None) -> logging.Logger:
    """The logger ``name`` (default ``persia_py``) at ``log_level``, printing to stderr
    (and appending to ``log_filename`` if given) with PERSIA's line format.

    Calling it again for the same name adds no second handler. When the root logger
    already has handlers (the program configured logging), records go there instead of
    to a handler of this logger, so nothing prints twice."""
    logger = logging.getLogger(name or DEFAULT_LOGGER_NAME)
    logger.setLevel(log_level)
    formatter = logging.Formatter(FORMAT)
    if not logging.getLogger().handlers and not any(
            isinstance(h, _PersiaHandler) for h in logger.handlers):
        handler = _PersiaHandler()
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    if log_filename is not None and not any(
            isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(log_filename)
            for h in logger.handlers):
        file_handler = logging.FileHandler(log_filename, mode="a")
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    return logger
