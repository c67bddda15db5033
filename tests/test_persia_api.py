"""PERSIA's helper names a ported script calls: ``persia_py.utils.setup_seed`` and
``persia_py.logger.get_default_logger``."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from persia_py.logger import get_default_logger
from persia_py.utils import setup_seed


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_setup_seed_makes_every_generator_repeat() -> None:
    setup_seed(7)
    first = _draws()
    setup_seed(8)
    other = _draws()
    setup_seed(7)
    assert _draws() == first
    assert all(a != b for a, b in zip(first, other))


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_setup_seed_names_a_bad_seed(seed) -> None:
    with pytest.raises(ValueError, match="seed"):
        setup_seed(seed)


def test_default_logger_prints_once_per_record(tmp_path, monkeypatch, capsys) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # a script that configured no logging
    name = f"persia-test-{tmp_path.name}"
    log_file = tmp_path / "train.log"
    logger = get_default_logger(name, log_filename=str(log_file))
    assert get_default_logger(name, log_filename=str(log_file)) is logger  # no second handler
    try:
        logger.info("step %d", 3)
        logger.debug("hidden at the default level")
        err = capsys.readouterr().err
        assert err.count("step 3") == 1 and "hidden" not in err
        assert "INFO" in err and "test_persia_api.py" in err
        assert log_file.read_text().count("step 3") == 1
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
