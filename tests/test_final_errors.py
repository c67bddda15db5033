"""A config error that ends a user's script started by persia-launcher before its role made
progress ends the role for good (persia_py/ops/final_errors.py): exit code 78, and on an
NN-worker rank a line in the rank-failed file that makes ``persia-launcher nn-worker``
stop torchrun. A data error (input that cannot be parsed) is final at any time: exit 65.
Any other error, one after progress, or one in a process the launcher did
not start, exits as usual (1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from persia_py.ops.final_errors import (
    CONFIG_EXIT_CODE,
    DATA_EXIT_CODE,
    ENV_FINAL_CONFIG_ERRORS,
    ENV_MAX_RESTARTS,
    ENV_RANK_FAILED_FILE,
    RANK_CONFIG_ERROR,
)

pytestmark = pytest.mark.processes

_PRELUDE = """
from persia_py.config import ConfigError
from persia_py.ops.final_errors import config_errors_are_final, made_progress

class Ctx:
    @config_errors_are_final
    def __init__(self, buffer_size):
        if buffer_size < 1:
            raise ValueError(f"Ctx(buffer_size=...): expected an int >= 1, got {buffer_size}")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV_FINAL_CONFIG_ERRORS, ENV_RANK_FAILED_FILE, ENV_MAX_RESTARTS)}
    return {**env, **extra}


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)]


@pytest.mark.parametrize("body,code", [
    # A config the script reads, before any progress: final.
    ("raise ConfigError('own.yml: common_config.rpc_timeout_secs: unknown key')",
     CONFIG_EXIT_CODE),
    # Arguments a context refuses as it is made: final.
    ("Ctx(buffer_size=0)", CONFIG_EXIT_CODE),
    # Not a config error: a restart may get past it.
    ("raise ValueError('a bad record in the data')", 1),
    ("raise ConnectionError('embedding worker unavailable')", 1),
    # After the first training step (or batch sent), even a config error is not one at start.
    ("made_progress()\nraise ConfigError('own.yml: late')", 1),
    ("made_progress()\nCtx(buffer_size=0)", 1),
    # Input that cannot be parsed: final in a data loader, before progress or after.
    ("from persia_py.input.readers import BadRecordError\n"
     "raise BadRecordError('a.csv', 3, \"column 'x': 'abc' is not a valid float\")",
     DATA_EXIT_CODE),
    ("from persia_py.ops.final_errors import DataError\nmade_progress()\n"
     "raise DataError('b.csv: row 9: column y: bad')", DATA_EXIT_CODE),
    # Caught and handled: no effect.
    ("try:\n    Ctx(buffer_size=0)\nexcept ValueError:\n    pass", 0),
])
def test_an_uncaught_config_error_before_progress_exits_78(body: str, code: int) -> None:
    done = subprocess.run(_script(body), env=_env(**{ENV_FINAL_CONFIG_ERRORS: "1"}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    if code == DATA_EXIT_CODE:  # where the data is wrong, without a traceback
        assert done.stderr.startswith("data error: ") and ".csv: row " in done.stderr, \
            done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    elif code:  # the traceback, as without the hook
        assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr


def test_a_script_the_launcher_did_not_start_exits_as_usual() -> None:
    done = subprocess.run(_script("raise ConfigError('own.yml: x')"), env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "ConfigError: own.yml: x" in done.stderr


def test_a_rank_reports_it_and_waits_for_its_launcher_to_stop_it(tmp_path) -> None:
    """Exiting at once would let torchrun (which looks every 0.1 s) start the ranks again
    before the launcher (every second) reads the file and stops it."""
    failed = tmp_path / "rank-failed"
    rank = subprocess.Popen(
        _script("raise ConfigError('own.yml: common_config.rpc_timeout_secs: unknown key')"),
        env=_env(**{ENV_FINAL_CONFIG_ERRORS: "1", ENV_RANK_FAILED_FILE: str(failed),
                    "RANK": "1"}), stderr=subprocess.DEVNULL)
    try:
        # As run_torchrun does: read the file while the rank runs.
        while not (failed.exists() and failed.read_text().endswith("\n")):
            with pytest.raises(subprocess.TimeoutExpired):
                rank.wait(timeout=0.05)
        assert failed.read_text() == (f"rank 1: {RANK_CONFIG_ERROR}: ConfigError: own.yml: "
                                      "common_config.rpc_timeout_secs: unknown key\n")
        with pytest.raises(subprocess.TimeoutExpired):  # it waits to be stopped
            rank.wait(timeout=2)
    finally:
        rank.kill()
        rank.wait(timeout=10)


def test_a_rank_nobody_restarts_reports_it_and_exits_at_once(tmp_path) -> None:
    """With no restarts (persia_py/launcher/local_ranks.py) no wait is needed: the node
    reads the file once it sees the rank exit."""
    failed = tmp_path / "rank-failed"
    done = subprocess.run(
        _script("raise ConfigError('own.yml: x: unknown key')"),
        env=_env(**{ENV_FINAL_CONFIG_ERRORS: "1", ENV_RANK_FAILED_FILE: str(failed),
                    ENV_MAX_RESTARTS: "0", "RANK": "1"}),
        capture_output=True, text=True, timeout=20)  # the wait would take 30 s
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr
    assert failed.read_text() == f"rank 1: {RANK_CONFIG_ERROR}: ConfigError: own.yml: x: unknown key\n"
