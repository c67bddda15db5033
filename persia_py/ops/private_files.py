"""Files and folders only their owner may use: a job's run folder, its logs, its token.

A local job's run folder holds its job token and the logs a restart trusts (a parameter
server's update log, a data loader's handover log and the positions a ``Rewind`` leaves
beside it), and the training log. Whoever can write into it could plant what a restart
then takes; whoever can read the logs learns what the job trained. So:

* :func:`private_folder` makes a run folder with mode 0700, set explicitly (not left to
  the umask), and refuses an existing one that another user owns or that group or others
  may write into, with an error that names the folder and the rule;
* every log is opened through :func:`open_private`: created 0600, and made 0600 when an
  earlier run left it wider;
* :func:`write_private_file` writes a small file (the token) whole, 0600, never through
  a link planted at its name.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
PRIVATE_FOLDER_MODE = 0o700


class UnsafeFolderError(ValueError):
    """A folder that others own or may write into, where the job keeps what it trusts."""


def private_folder(path: str | os.PathLike, what: str = "run folder") -> Path:
    """Make ``path`` (mode 0700) unless it exists, then check it (:func:`check_private_folder`);
    its parents are made as usual."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_FOLDER_MODE)
        os.chmod(path, PRIVATE_FOLDER_MODE)  # the umask may have taken the owner's bits
    except FileExistsError:
        pass
    check_private_folder(path, what)
    return path


def check_private_folder(path: str | os.PathLike, what: str = "run folder") -> None:
    """Raise :class:`UnsafeFolderError` unless ``path`` is a folder of this user's that
    group and others cannot write into."""
    st = os.stat(path)
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(f"{what} {path}: not a folder")
    if st.st_uid != uid:
        raise UnsafeFolderError(
            f"{what} {path}: owned by uid {st.st_uid}, not by this user (uid {uid}); a {what} "
            "must be this user's own: choose another folder")
    if mode & 0o022:
        raise UnsafeFolderError(
            f"{what} {path}: group or others may write into it (mode {mode:04o}); a {what} "
            f"must be writable by its owner only: chmod go-w {path}, or choose another folder")


def open_private(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags)`` of a file only its owner may read or write: created with
    mode 0600, and set to 0600 if it existed with another mode. Returns the descriptor."""
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_private(path: str | os.PathLike, *, buffering: int = -1):
    """A text file open for appending, private (:func:`open_private`)."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return os.fdopen(fd, "a", buffering=buffering)


def write_private_file(path: str, text: str) -> str:
    """Write ``text`` to ``path``, readable by its owner only (mode 0600); returns the path.

    The file is made anew beside ``path`` (``mkstemp``: 0600, never through a link) and
    renamed over it, so a link or a looser file already at ``path`` is replaced, never
    followed or reused.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return os.path.abspath(path)


__all__ = ["PRIVATE_FILE_MODE", "PRIVATE_FOLDER_MODE", "UnsafeFolderError", "append_private",
           "check_private_folder", "open_private", "private_folder", "write_private_file"]
