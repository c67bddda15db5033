"""A config error that ends a user's script before its role made progress ends the role
for good, with :data:`CONFIG_EXIT_CODE`.

``persia-launcher`` checks both config files before it starts a user's script (the NN
worker's training script under torchrun, a data loader's script), but the script can
still stop on a config error of its own: a config file it reads through
:mod:`persia_py.config` (a :class:`~persia_py.config.ConfigError` naming the file and the
key), or arguments a context refuses as it is made (:func:`config_errors_are_final`).
torchrun, ``persia-launcher local`` and Kubernetes would start the script again into the
same error. So in a process that ``persia-launcher`` started for a user's script
(:data:`ENV_FINAL_CONFIG_ERRORS`: importing persia_py installs the hook then, see
persia_py/__init__.py), an uncaught config error raised before the role made
progress

* is printed as any uncaught error;
* on an NN-worker rank, is written to ``$PERSIA_RANK_FAILED_FILE`` as
  :data:`RANK_CONFIG_ERROR` (torchrun restarts ranks whatever
  their exit code, so ``persia-launcher nn-worker`` stops it on that line and exits 78:
  :func:`persia_py.launcher.processes.run_torchrun`), and the rank waits to be stopped,
  unless no restart may follow;
* ends the process with exit code 78 (a data loader's role passes it on).

Progress (:func:`made_progress`) is a rank's first training step or a loader's first
batch sent. An error after it, a config error too, is an ordinary failure: the role is
restarted and goes on from its progress (a checkpoint, its handover log). A network
error is never a config error (none is a ConfigError, nor raised inside
:func:`refusals_are_config_errors` as a ValueError or TypeError).

A :class:`DataError` (input that cannot be parsed: a bad value, a missing or extra
column, bad encoding; :class:`persia_py.input.readers.BadRecordError` is one) is final
at any time in a data loader: the same input is there again after a restart. Its
``DataCtx`` ends the stream for the NN workers, so every batch made before it is
trained (and, online, checkpointed), then the process prints the error, which names the
file, row and column, and exits :data:`DATA_EXIT_CODE`. ``persia-launcher`` never
restarts it: fixed or removed, the same command goes on from the checkpoint.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

# Only the standard library below: every import of persia_py loads this module.
from persia_py.ops.private_files import append_private

__all__ = ["CONFIG_EXIT_CODE", "DATA_EXIT_CODE", "DataError", "RANK_CONFIG_ERROR",
           "config_errors_are_final", "install_from_environ", "is_config_error",
           "made_progress", "refusals_are_config_errors", "report_failure"]

CONFIG_EXIT_CODE = 78
"""Exit code of a role that stopped on a config error (``EX_CONFIG`` of sysexits.h):
final, never restarted."""
DATA_EXIT_CODE = 65
"""Exit code of a data loader that stopped on input it cannot parse (``EX_DATAERR`` of
sysexits.h, :class:`DataError`): final, never restarted."""
RANK_CONFIG_ERROR = "stopped on a config error"
"""What an NN-worker rank's line in ``$PERSIA_RANK_FAILED_FILE`` says when it stopped on
a config error before its first training step (its script's, or ``TrainCtx``'s refusal
of its arguments or config); ``persia-launcher nn-worker`` then stops torchrun (which
would restart the ranks into the same error) and exits :data:`CONFIG_EXIT_CODE`."""
ENV_FINAL_CONFIG_ERRORS = "PERSIA_FINAL_CONFIG_ERRORS"
"""``1``: this process runs a user's script for ``persia-launcher``, which takes a config
error before any progress as final."""
ENV_RANK_FAILED_FILE = "PERSIA_RANK_FAILED_FILE"
"""Where an NN-worker rank that fails writes why, for ``persia-launcher nn-worker``."""

_MARK = "_persia_config_error_at_start"
"""Attribute set on an error :func:`refusals_are_config_errors` let through."""

_STOPPED_WITHIN_SEC = 30.0
"""Longest a rank that reported a config error waits for its node's launcher to stop it.
The launcher reads the file every second; a rank that exited first would have torchrun
start the ranks again (its monitor looks every 0.1 s), into the same error. A rank
started with no restarts (:data:`ENV_MAX_RESTARTS` ``0``) exits at once: its launcher
reads the file when it sees the rank exit (persia_py/launcher/local_ranks.py)."""
ENV_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
"""torchrun's restarts of this rank (``0``: none)."""


class DataError(ValueError):
    """Input a data loader cannot parse; the message says where (file, row, column).
    Final: raised uncaught in a data loader ``persia-launcher`` started, it ends the
    loader with :data:`DATA_EXIT_CODE` after the batches made before it are trained
    (module docstring). A user's own reader may raise it too."""


def report_failure(rank: int, exc: BaseException, *, config: bool = False) -> None:
    """Tell this node's launcher why this rank fails (``persia-launcher nn-worker``
    watches for it: :func:`persia_py.launcher.processes.run_torchrun`); ``config``: a
    config error at start, which a restart would meet again."""
    path = os.environ.get(ENV_RANK_FAILED_FILE)
    if not path:
        return
    what = f"{RANK_CONFIG_ERROR}: " if config else ""
    try:
        with append_private(path) as f:
            f.write(f"rank {rank}: {what}{type(exc).__name__}: {exc}"[:4000] + "\n")
    except OSError:
        pass  # the launcher then waits for torchrun alone


@contextmanager
def refusals_are_config_errors() -> Iterator[None]:
    """A ValueError or TypeError raised inside (an argument or config refused as given) is
    a config error: uncaught, it ends the role for good."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        setattr(exc, _MARK, True)
        raise


def config_errors_are_final(init: Callable[..., None]) -> Callable[..., None]:
    """Decorate a context's ``__init__``: a ValueError or TypeError it raises (a config
    file or argument it refuses, before anything ran) is a config error
    (:func:`refusals_are_config_errors`)."""

    @functools.wraps(init)
    def checked(self: object, *args: object, **kwargs: object) -> None:
        with refusals_are_config_errors():
            init(self, *args, **kwargs)

    return checked


def is_config_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a config error a restart would meet again: a ConfigError, or an
    error a context refused its arguments with (:func:`refusals_are_config_errors`)."""
    # Not imported here (it loads numpy and yaml); a process that never imported it
    # raised no ConfigError.
    strict = sys.modules.get("persia_py.config.strict")
    return ((strict is not None and isinstance(exc, strict.ConfigError))
            or getattr(exc, _MARK, False) is True)


class _FinalErrors:
    """``sys.excepthook`` of a user's script that ``persia-launcher`` started: a config
    error before progress, or a data error in a data loader, ends it for good."""

    def __init__(self, previous: Callable[..., object]) -> None:
        self.previous = previous
        self.progress = False

    def __call__(self, exc_type: type[BaseException], exc: BaseException,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, DataError) and not os.environ.get(ENV_RANK_FAILED_FILE):
            # Where the data is wrong is the whole message: no traceback into the reader.
            print(f"data error: {exc}\nthe data loader stops for good (exit code "
                  f"{DATA_EXIT_CODE}) after the batches made before it are trained: fix or "
                  "remove the input, then run the same command again (it goes on from the "
                  "last checkpoint)", file=sys.stderr, flush=True)
            raise SystemExit(DATA_EXIT_CODE)
        self.previous(exc_type, exc, tb)  # the traceback, as without this hook
        if self.progress or not is_config_error(exc):
            return
        if os.environ.get(ENV_RANK_FAILED_FILE):
            report_failure(int(os.environ.get("RANK", "0") or 0), exc, config=True)
            sys.stderr.flush()
            if os.environ.get(ENV_MAX_RESTARTS) != "0":  # else nobody would restart it
                threading.Event().wait(_STOPPED_WITHIN_SEC)  # SIGKILL from the launcher
        # Raised by the hook, SystemExit sets the exit code of the ending interpreter.
        raise SystemExit(CONFIG_EXIT_CODE)


def install_from_environ() -> None:
    """In a process ``persia-launcher`` started for a user's script
    (``$PERSIA_FINAL_CONFIG_ERRORS``), make an uncaught config error end it with
    ``CONFIG_EXIT_CODE`` until :func:`made_progress`, and a data error with
    ``DATA_EXIT_CODE`` (not on an NN rank); elsewhere, nothing."""
    if os.environ.get(ENV_FINAL_CONFIG_ERRORS) and not isinstance(sys.excepthook,
                                                                  _FinalErrors):
        sys.excepthook = _FinalErrors(sys.excepthook)


def made_progress() -> None:
    """The role made progress (a rank's training step, a loader's batch sent): from now on
    an uncaught config error is an ordinary failure, which the role's supervisor may
    restart. Cheap, and nothing after the first call."""
    if isinstance(sys.excepthook, _FinalErrors):
        sys.excepthook.progress = True
