"""The run folder of a ``persia-launcher local`` job: made, and cleared of the update logs.

It holds the job token, the training log and the logs a restart inside the job trusts.
:func:`make_run_folder` makes it private before anything is started there
(persia_py/ops/private_files.py); :func:`remove_update_logs` deletes the parameter servers'
update logs once the job has ended, since a new launch never replays them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from datetime import datetime

from persia_py.ops.private_files import UnsafeFolderError, private_folder
from persia_py.ops.start_checks import Written, check_writable
from persia_py.wire.address_book import ADDRESS_BOOK_FILE


def make_run_folder(given: str | None) -> tuple[str, str]:
    """The run folder (``--run-dir``, default ``runs/local-<date>-<time>-<pid>``; made
    0700; refused when another user owns it or others may write into it, and, as a
    ConfigError, when this user cannot write it) and the training log's path in it."""
    run_dir = os.path.abspath(given or os.path.join(
        "runs", f"local-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"))
    # Every role writes its logs there: a ConfigError (final) before anything is made.
    check_writable([Written(run_dir, "--run-dir" if given else
                            "the run folder (--run-dir's default)")])
    try:
        private_folder(run_dir, "run folder")
    except UnsafeFolderError as exc:
        raise SystemExit(f"--run-dir: {exc}") from None
    train_log = os.path.join(run_dir, "train_log.jsonl")
    print(f"[launcher] run folder {run_dir}; training log {train_log}", flush=True)
    return run_dir, train_log


def update_log_folder(run_dir: str, index: int) -> str:
    """Where parameter server ``index`` keeps its update log."""
    return os.path.join(run_dir, f"ps-{index}-updates")


def address_book_file(run_dir: str) -> str:
    """Where the job's address book is (persia_py/wire/address_book.py)."""
    return os.path.join(run_dir, ADDRESS_BOOK_FILE)


def handover_log_file(run_dir: str, index: int) -> str:
    """Where data loader ``index`` keeps its handover log."""
    return os.path.join(run_dir, f"data-loader-{index}-handovers.log")


def remove_update_logs(run_dir: str, num_ps: int, log: Callable[[str], None]) -> None:
    """Delete the parameter servers' update logs once every role has stopped: only a
    restart inside this job replays one (a new launch begins a new log), and they hold
    every update since the last checkpoint (gigabytes over a long run without one)."""
    freed = 0
    for i in range(num_ps):
        folder = update_log_folder(run_dir, i)
        if not os.path.isdir(folder) or os.path.islink(folder):
            continue
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                freed += entry.stat(follow_symlinks=False).st_size
        shutil.rmtree(folder, ignore_errors=True)
    if freed:
        log(f"update logs removed ({freed / 2**20:,.0f} MiB): only a restart inside the job "
            "replays them")
