"""Config checks that depend on where a role runs, made as it starts; and (from
:mod:`persia_py.ops.final_errors`) the exit code of a role that stops on a config error.

A config file is checked key by key when it is read (:mod:`persia_py.config`). A few keys
are right or wrong only relative to the process that uses them: ``checkpoint_config.dir``
and ``incremental_dir`` must lie in the job's checkpoint root, which is
``checkpoint_config.root`` or, unset, the current directory of each process (a parameter
server's ``--checkpoint-root`` overrides it). Left to the first checkpoint, such an error
would cost the training up to it, and a supervisor would restart the job into the same
error. So ``persia-launcher local`` checks them before it starts any process, each
``persia-launcher`` role as it starts, and ``TrainCtx`` when it is made; and a role that
stops on a config error before it made any progress (a user's script too:
:mod:`persia_py.ops.final_errors`) exits with :data:`CONFIG_EXIT_CODE`, which
``persia-launcher local`` and the Kubernetes manifests take as final: no restart (it
would stop the same way).

The folders a role writes are tried the same way (:func:`check_writable`): a folder the
role's user cannot write (a checkpoint folder, an export folder, the run folder, a log's
folder) would stop it at its first write, again after every restart. Each role tries
those it writes itself, as that user, by creating and removing a file in each (mode bits
say nothing for root, a read-only mount or an NFS export that maps root to nobody):
``persia-launcher local`` all of them before it starts a process (every role runs as its
user), a parameter server its checkpoint folders, exports and update log, an NN worker
the checkpoint and dense export folders and the training log, a data loader its
handover log, :func:`persia_py.stream_source.follow` its position log.
"""

from __future__ import annotations

import errno
import os
import posixpath
import pwd
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

from persia_py.config import CheckpointConfig, ConfigError
from persia_py.ops import safe_files
from persia_py.ops.final_errors import CONFIG_EXIT_CODE, RANK_CONFIG_ERROR

__all__ = ["CONFIG_EXIT_CODE", "RANK_CONFIG_ERROR", "Written", "check_checkpoint_paths",
           "check_writable", "written_by_servers", "written_by_training"]


_RULES = {
    # key -> (allowed depths below the root, the rule in words)
    "dir": ((0, 1), "the root or a folder directly in it (ROOT or ROOT/NAME; its "
                    "checkpoints are folders in it)"),
    "incremental_dir": ((1, 2), "a folder in the root (ROOT/NAME or ROOT/NAME/NAME)"),
}


def _plain(name: str) -> bool:
    try:
        safe_files.check_name(name, "folder")
    except safe_files.InvalidName:
        return False
    return True


def check_checkpoint_paths(config: CheckpointConfig, *, root: str | os.PathLike | None = None,
                           pod_dir: str | None = None) -> None:
    """ConfigError (naming the key, its value and the rule) unless ``checkpoint_config.dir``
    and ``incremental_dir`` lie where the servers can write them: in the checkpoint root
    ``root`` (a server's ``--checkpoint-root``; None: ``config.root``, else the current
    directory), each folder on the way a plain name.

    ``pod_dir``: check the paths as written, for processes that run elsewhere with this
    folder as their current directory (Kubernetes pods: the image's ``WORKDIR``); links
    are not resolved then."""
    given = root if root is not None else config.root
    if root is not None:
        where = "the server's --checkpoint-root"
    elif config.root is not None:
        where = "checkpoint_config.root"
    else:
        where = ("checkpoint_config.root is unset: the current directory" if pod_dir is None
                 else "checkpoint_config.root is unset: the pods' working directory")
    base: PurePath
    if pod_dir is None:
        local_root = safe_files.configured_root(given)
        if local_root.exists() and not local_root.is_dir():  # the servers would fail to make it
            raise ConfigError(f"checkpoint_config.root: {os.fspath(given or '.')!r} ({where}) "
                              "is a file; the checkpoint root must be a folder")
        base = local_root
    else:
        base = PurePosixPath(posixpath.normpath(posixpath.join(pod_dir, given or ".")))
    path: PurePath
    problem: str | None
    for key, (depths, rule) in _RULES.items():
        value = getattr(config, key)
        if value is None:
            continue
        if pod_dir is None:
            path = Path(os.path.realpath(value))
        else:
            path = PurePosixPath(posixpath.normpath(posixpath.join(pod_dir, value)))
        parts = path.relative_to(base).parts if path.is_relative_to(base) else None
        if parts is None:
            problem = "lies outside"
        elif not parts and 0 not in depths:
            problem = "is"
        elif len(parts) not in depths:
            problem = "lies too deep in"
        else:
            problem = next((f"has {part!r}, not a plain name (letters, digits, '_', '.', "
                            "'-'), on its way from" for part in parts
                            if not _plain(part)), None)
        if problem is not None:
            raise ConfigError(
                f"checkpoint_config.{key}: {value!r} {problem} the checkpoint root {base} "
                f"({where}); it must be {rule}. The parameter servers read and write only "
                "inside the root: set checkpoint_config.root to a folder that holds it, or "
                "move it there")


# -- folders a role writes ------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """A folder a role writes into, or a file it appends to, and what named it."""

    path: str | os.PathLike
    """As configured: relative to the role's current directory."""
    source: str
    """The config key, flag or argument that named it (``checkpoint_config.dir``,
    ``--update-log``), for the message."""
    file: bool = False
    """``path`` is a file (a log): its folder must take new files, and the file, where it
    exists already, must open for writing."""


def written_by_servers(config: CheckpointConfig, *,
                       root: str | os.PathLike | None = None) -> list[Written]:
    """What a training parameter server writes: its checkpoint root when it is set and
    missing (made at start: ``root``, a server's ``--checkpoint-root``, else
    ``config.root``), ``dir`` (its part of each checkpoint), ``incremental_dir`` while it
    exports increments. A root that exists and nothing to write into it is fine read-only
    (a job that only loads a checkpoint)."""
    written = []
    given, key = ((root, "--checkpoint-root") if root is not None
                  else (config.root, "checkpoint_config.root"))
    if given is not None and not os.path.isdir(given):
        written.append(Written(given, key))
    if config.dir is not None:
        written.append(Written(config.dir, "checkpoint_config.dir"))
    if config.incremental_dir is not None and (config.incremental_every_updates
                                               or config.incremental_every_sec):
        written.append(Written(config.incremental_dir, "checkpoint_config.incremental_dir"))
    return written


def written_by_training(config: CheckpointConfig) -> list[Written]:
    """What the NN ranks write: ``dir`` (rank 0's part of each checkpoint; every rank's
    under FSDP) and ``dense_export_dir`` while rank 0 exports the dense model."""
    written = []
    if config.dir is not None:
        written.append(Written(config.dir, "checkpoint_config.dir"))
    if config.dense_export_dir is not None and (config.dense_export_every_steps
                                                or config.dense_export_every_sec):
        written.append(Written(config.dense_export_dir, "checkpoint_config.dense_export_dir"))
    return written


_CANNOT_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)
"""Errors of a write no retry gets past. Others (a full disk) may pass: the role meets
them at its write, if they last."""


def this_user() -> str:
    """``user NAME (uid N)``: whom this process writes as (its effective uid)."""
    uid = os.geteuid()
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:  # an arbitrary uid (OpenShift, docker run --user)
        return f"uid {uid} (no user of that uid in the user database)"


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _existing(path: str) -> tuple[str, str | None]:
    """(``path`` or its nearest existing parent; None, or why it cannot be reached)."""
    while True:
        try:
            os.stat(path)
            return path, None
        except (FileNotFoundError, NotADirectoryError):  # a file on the way: said below
            parent = os.path.dirname(path)
            if parent == path:
                return path, None
            path = parent
        except OSError as exc:  # a folder on the way this user may not enter
            return path, f"{path!r} cannot be reached ({_why(exc)})"


def _problem(target: Written) -> str | None:
    """Why this process cannot write ``target``; None: it can (or may)."""
    path = os.path.abspath(target.path)
    folder = os.path.dirname(path) if target.file else path
    existing, unreachable = _existing(folder)
    if unreachable is not None:
        return unreachable
    if not os.path.isdir(existing):
        return f"{existing!r} is a file, not a folder"
    probe = os.path.join(existing, f".persia-write-check-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        if exc.errno not in _CANNOT_WRITE:
            return None
        it = f"its folder {folder!r}" if target.file else "it"
        if existing == folder:
            return f"no file can be made in {it} ({_why(exc)})"
        return f"{it} does not exist, and no folder can be made in {existing!r} ({_why(exc)})"
    os.close(fd)
    os.unlink(probe)
    if not target.file or existing != folder:
        return None
    try:  # the log as it is, if an earlier run left one: opened as the role will
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return "it is a folder, not a file"
    except OSError as exc:
        return (f"the file exists and does not open for writing ({_why(exc)})"
                if exc.errno in _CANNOT_WRITE else None)
    os.close(fd)
    return None


def check_writable(written: Iterable[Written]) -> None:
    """ConfigError naming every one of ``written`` this process cannot write, the key or
    flag that named it, and the user it runs as; nothing is left behind. Each is tried:
    a file is made and removed in the folder, or, where the folder is missing, in its
    nearest existing parent (the role would make the folder there); a log that exists
    already is opened for writing."""
    problems: dict[str, str] = {}
    for target in written:
        problem = _problem(target)
        if problem is not None:
            problems.setdefault(f"{target.source}: {os.fspath(target.path)!r}", problem)
    if problems:
        user = this_user()
        raise ConfigError(
            "\n".join(f"{what} cannot be written by {user}: {why}"
                      for what, why in problems.items())
            + "\nThe job writes there: make " + ("it" if len(problems) == 1 else "each")
            + " writable for that user (chown, chmod, or the volume's owner or mount "
              "options), or configure a folder it can write")
