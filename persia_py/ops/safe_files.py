"""Files and folders opened safely: plain names only, never through a link, written new.

Servers read and write only inside folders they were given, by names checked here
(:func:`check_name`), and open every file and folder without following a link
(``O_NOFOLLOW``, relative to an already opened folder): a link planted under a file's name,
or a name read from a stored JSON description, never leads outside that folder. Arrays are
``.npy`` files (``allow_pickle=False``) and descriptions JSON, each fsync'd when written.
Checkpoints (:mod:`persia_py.checkpoint.layout`), update logs and increments build on these.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

TMP_PREFIX = "tmp-"
"""Prefix of a folder being written (ignored by readers, removed by the next writer)."""

class CheckpointError(ValueError):
    """A checkpoint (or another stored file: a log segment, an increment) that is missing,
    incomplete, unsafe to open, or does not fit this job."""


# -- names and files ----------------------------------------------------------------------
#
# Servers read and write only inside folders they were given, by names checked here, and
# open every file and folder without following a link (``O_NOFOLLOW``, relative to an
# already opened folder): a link planted under a checkpoint file's name, or a name read
# from a checkpoint's JSON, never leads outside that folder.

MAX_NAME_CHARS = 128
"""Longest file or folder name a checkpoint uses or a request may name."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest JSON file read from a checkpoint (its descriptions are a few kB)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o640


class InvalidName(CheckpointError):
    """A name that is not a plain file or folder name (see :func:`check_name`)."""


def check_name(value: object, field: str) -> str:
    """``value`` if it is a plain name: 1 to ``MAX_NAME_CHARS`` characters out of letters,
    digits, ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``; so never a path, ``.``,
    ``..``, a hidden name or one with a NUL. Raises :class:`InvalidName` naming ``field``."""
    if not isinstance(value, str) or not value:
        raise InvalidName(f"{field}: a name is required, got {value!r}")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidName(f"{field}: a name has at most {MAX_NAME_CHARS} characters, got "
                          f"{len(value)}")
    if not _NAME.fullmatch(value):
        raise InvalidName(f"{field}: {value[:MAX_NAME_CHARS]!r} is not a plain name (letters, "
                          "digits, '_', '.', '-'; not starting with '.' or '-'; no '/')")
    return value


def open_dir_at(parent_fd: int | None, name: str | os.PathLike) -> int:
    """A file descriptor of folder ``name`` in ``parent_fd`` (None: ``name`` is a path),
    opened without following a link at its last component. The caller closes it."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        raise CheckpointError(f"folder {os.fspath(name)!r} does not exist") from None
    except (NotADirectoryError, OSError) as exc:
        if isinstance(exc, NotADirectoryError) or exc.errno == errno.ELOOP:
            raise CheckpointError(f"{os.fspath(name)!r} is not a folder (a link or a "
                                  "file)") from None
        raise


@contextlib.contextmanager
def opened_dir(parent_fd: int | None, name: str | os.PathLike) -> Iterator[int]:
    """:func:`open_dir_at` as a context manager that closes the descriptor."""
    fd = open_dir_at(parent_fd, name)
    try:
        yield fd
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike | int) -> None:
    """fsync a folder, named by path or by an open descriptor."""
    if isinstance(path, int):
        os.fsync(path)
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(dir_fd: int, name: str):
    """A new file ``name`` in ``dir_fd`` open for binary writing: never an existing file,
    never through a link (``O_CREAT | O_EXCL | O_NOFOLLOW``)."""
    check_name(name, "file name")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(name, flags, _FILE_MODE, dir_fd=dir_fd), "wb")


def _open_read(dir_fd: int, name: str, field: str):
    check_name(name, field)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {name} is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint file {name} is a link; refused") from None
        raise
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise CheckpointError(f"checkpoint file {name} is not a regular file")
    return f


def save_array_at(dir_fd: int, name: str, array: np.ndarray) -> int:
    """Write ``array`` as the new ``.npy`` file ``name`` in ``dir_fd`` (no pickle), fsync'd;
    returns its size in bytes."""
    array = np.asarray(array)
    if array.dtype.hasobject:
        raise TypeError(f"{name}: object arrays cannot be checkpointed")
    with _create(dir_fd, name) as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def save_json_at(dir_fd: int, name: str, data: Any) -> None:
    """Write ``data`` as the new JSON file ``name`` in ``dir_fd``, fsync'd (floats keep every
    bit: json writes their repr)."""
    with _create(dir_fd, name) as f:
        f.write(json.dumps(data, indent=1, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())


def load_array_at(dir_fd: int, name: str, *, mmap: bool = False,
                  field: str = "file name") -> np.ndarray:
    """The ``.npy`` file ``name`` in ``dir_fd`` (memory-mapped read-only with ``mmap``)."""
    with _open_read(dir_fd, name, field) as f:
        try:
            if not mmap:
                return np.load(f, allow_pickle=False)
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject:
                raise ValueError("object arrays are not allowed")
            if not shape or 0 in shape:
                return np.zeros(shape, dtype)  # mmap cannot map an empty range
            return np.memmap(f, dtype=dtype, mode="r", shape=shape, offset=f.tell(),
                             order="F" if fortran else "C")
        except (ValueError, OSError, EOFError) as exc:
            raise CheckpointError(f"checkpoint file {name} is not a valid .npy file: "
                                  f"{exc}") from None


def load_json_at(dir_fd: int, name: str, *, field: str = "file name") -> Any:
    """The JSON file ``name`` in ``dir_fd``."""
    with _open_read(dir_fd, name, field) as f:
        raw = f.read(_MAX_JSON_BYTES + 1)
    if len(raw) > _MAX_JSON_BYTES:
        raise CheckpointError(f"checkpoint file {name} is over {_MAX_JSON_BYTES} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint file {name} is not valid JSON: {exc}") from None


def _split(path: str | os.PathLike) -> tuple[str, str]:
    path = os.fspath(path)
    return os.path.dirname(path) or ".", os.path.basename(path)


def save_array(path: str | os.PathLike, array: np.ndarray) -> int:
    """:func:`save_array_at` by path (a new file in an existing folder)."""
    folder, name = _split(path)
    with opened_dir(None, folder) as fd:
        return save_array_at(fd, name, array)


def load_array(path: str | os.PathLike, mmap: bool = False) -> np.ndarray:
    """:func:`load_array_at` by path."""
    folder, name = _split(path)
    with opened_dir(None, folder) as fd:
        return load_array_at(fd, name, mmap=mmap)


def save_json(path: str | os.PathLike, data: Any) -> None:
    """:func:`save_json_at` by path."""
    folder, name = _split(path)
    with opened_dir(None, folder) as fd:
        save_json_at(fd, name, data)


def load_json(path: str | os.PathLike) -> Any:
    """:func:`load_json_at` by path."""
    folder, name = _split(path)
    with opened_dir(None, folder) as fd:
        return load_json_at(fd, name)


def new_dir_at(parent_fd: int, prefix: str = TMP_PREFIX, mode: int = 0o700) -> tuple[str, int]:
    """Create a folder with a fresh random name in ``parent_fd`` (like ``mkdtemp``); returns
    (its name, an open descriptor of it)."""
    name = f"{prefix}{uuid.uuid4().hex}"
    os.mkdir(name, mode, dir_fd=parent_fd)
    return name, open_dir_at(parent_fd, name)


def remove_flat_dir(parent_fd: int, name: str, fd: int) -> None:
    """Remove folder ``name`` of ``parent_fd`` (open as ``fd``, which is closed) and the
    files in it (a folder this process made and filled with files only)."""
    try:
        for left in os.listdir(fd):
            os.unlink(left, dir_fd=fd)
    finally:
        os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)


@contextlib.contextmanager
def private_dir(parent_fd: int) -> Iterator[int]:
    """A new folder of this process's own in ``parent_fd`` (:func:`new_dir_at`, mode 0700,
    a hidden name), as an open descriptor; on exit it is removed with whatever is left in
    it. Files are written there and then moved into place (:func:`move_into`)."""
    name, fd = new_dir_at(parent_fd, f".{TMP_PREFIX}")
    try:
        yield fd
    finally:
        remove_flat_dir(parent_fd, name, fd)


def move_into(src_fd: int, dst_fd: int, names: list[str]) -> None:
    """Rename files ``names`` from folder ``src_fd`` into ``dst_fd``, in order (a renamed
    file replaces a link of its name, never the link's target), then fsync ``dst_fd``."""
    for name in names:
        os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
    os.fsync(dst_fd)


# -- the root ---------------------------------------------------------------------------


def configured_root(root: str | os.PathLike | None) -> Path:
    """The checkpoint root of this process: ``checkpoint_config.root`` (or a server's
    ``--checkpoint-root``), else the current directory; links resolved."""
    return Path(os.path.realpath(root if root else os.getcwd()))
