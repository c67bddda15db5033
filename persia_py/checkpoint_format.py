"""The on-disk checkpoint format: plain ``.npy`` arrays and JSON, written crash-safely.

A checkpoint *root* (the directory a user names) holds complete checkpoints and a
pointer to the newest one::

    ROOT/
      LATEST                        # one line: the name of the newest complete checkpoint
      ckpt-000000000120-1a2b3c4d/   # one complete checkpoint
        manifest.json               # written last: what the checkpoint holds
        ps-0.json                   # replica 0: optimizer settings, its tables and files
        ps-0-t0-ids.npy             # uint64 [rows]     table 0 of replica 0
        ps-0-t0-weights.npy         # float32 [rows, dim] (float16 rows: float16; bfloat16: uint16 bits)
        ps-0-t0-state.npy           # float32 [rows, state width] (optimizer state)
        ps-0-t0-last_access.npy     # int64 [rows]      LRU clock of each row
        ps-0-seen0.npy              # int64 [n]  exactly-once window of one embedding worker
        dense-model.json            # model state_dict: names, dtypes, files
        dense-model-0.npy ...
        dense-optimizer.json        # dense optimizer state_dict (numbers, param groups)
        dense-optimizer-0.npy ...

Every array is a ``.npy`` file (numpy's documented format, read and written with
``allow_pickle=False``); every description is JSON. Nothing is pickled.

**Crash safety.** A checkpoint is written into ``ROOT/tmp-<uuid>``; every file is
fsync'd, the manifest is written last, then the folder is renamed to its final name and
``LATEST`` is replaced atomically (``os.replace`` of a fsync'd temporary file). A crash
at any moment leaves ``LATEST`` naming the previous complete checkpoint; leftover
``tmp-*`` folders are ignored and removed by the next successful write. Loading refuses a
folder without a manifest. A parameter server writes its files into a private folder
(mode 0700, a random name) inside the checkpoint being written, then renames them into
it, ``ps-<r>.json`` last.

**Trust.** Every file is created new (``O_CREAT | O_EXCL``) and every file and folder is
opened without following a link (``O_NOFOLLOW``), relative to an open folder; file
names read from a checkpoint's JSON must be plain names (:func:`check_name`), so a
crafted checkpoint or a planted link cannot reach outside the checkpoint's folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported by the dense functions only: servers never need it
    import torch

FORMAT = "persia_py-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
_TMP_PREFIX = "tmp-"
_KEEP = 2
"""Complete checkpoints kept in a root (the newest ones); older ones are removed."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit this job."""


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


def new_dir_at(parent_fd: int, prefix: str = _TMP_PREFIX, mode: int = 0o700) -> tuple[str, int]:
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
    name, fd = new_dir_at(parent_fd, f".{_TMP_PREFIX}")
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


# -- the root: temporary folders, commit, LATEST --------------------------------------------


def new_tmp_dir(root: str | os.PathLike, token: str | None = None) -> Path:
    """Create ``ROOT/tmp-<token>`` (a fresh uuid by default) for a checkpoint being written."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP_PREFIX}{token or uuid.uuid4().hex}"
    tmp.mkdir(exist_ok=True)
    return tmp


def commit(tmp: str | os.PathLike, manifest: dict, *, step: int) -> Path:
    """Finish a checkpoint: write its manifest, rename it, point ``LATEST`` at it.

    Every other file must already be in ``tmp`` and fsync'd. Returns the final folder.
    """
    tmp = Path(tmp)
    root = tmp.parent
    # written_as: the parameter servers' update logs know a checkpoint by the folder
    # they dumped into (servers/update_log.py).
    save_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": step,
                               "written_as": tmp.name, **manifest})
    fsync_dir(tmp)
    final = root / f"ckpt-{step:012d}-{uuid.uuid4().hex[:8]}"
    os.rename(tmp, final)
    fsync_dir(root)
    pointer = root / f"{_TMP_PREFIX}{uuid.uuid4().hex}.latest"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    _prune(root, keep=final.name)
    return final


def _prune(root: Path, keep: str) -> None:
    """Remove leftover temporaries and all but the newest ``_KEEP`` checkpoints."""
    complete = sorted((p for p in root.iterdir() if p.name.startswith("ckpt-") and p.is_dir()),
                      key=lambda p: p.stat().st_mtime_ns)
    old = [p for p in complete[:-_KEEP] if p.name != keep]
    for path in old + [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder that ``path`` names.

    ``path`` is a checkpoint root (its ``LATEST`` is followed) or one checkpoint folder.
    Raises :class:`CheckpointError` unless the folder has a manifest of this format.
    """
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / check_name((path / LATEST).read_text().strip(), f"{path / LATEST}")
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}; an "
                              "interrupted write leaves none)")
    check_manifest(load_json(manifest), str(manifest))
    return path


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``root`` (or ``root`` itself, if it is one);
    None: none there yet."""
    try:
        return resolve(root)
    except CheckpointError:
        return None


def check_manifest(data: Any, where: str, kind: str = FORMAT) -> dict:
    """``data`` if it is a manifest of this ``kind`` and version; CheckpointError if not."""
    if not isinstance(data, dict) or data.get("format") != kind or data.get("version") != VERSION:
        raise CheckpointError(f"{where}: not a {kind} version {VERSION} manifest")
    return data


def configured_root(root: str | os.PathLike | None) -> Path:
    """The checkpoint root of this process: ``checkpoint_config.root`` (or a server's
    ``--checkpoint-root``), else the current directory; links resolved."""
    return Path(os.path.realpath(root if root else os.getcwd()))


def names_in_root(root: Path, folder: str | os.PathLike, what: str) -> list[str]:
    """The names that lead from ``root`` to ``folder``: one (``ROOT/NAME``) or two
    (``ROOT/NAME/NAME``), each a plain name. Checkpoint calls carry these, never paths.
    CheckpointError (naming ``what``) if ``folder`` lies elsewhere."""
    real = Path(os.path.realpath(folder))
    parts = real.relative_to(root).parts if real.is_relative_to(root) else ()
    if len(parts) not in (1, 2):
        raise CheckpointError(
            f"{what}: {os.fspath(folder)!r} must lie directly in the checkpoint root {root} "
            f"or in a folder directly in it (ROOT/NAME or ROOT/NAME/NAME; set "
            f"checkpoint_config.root)")
    return [check_name(part, what) for part in parts]


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint ``path`` names (see :func:`resolve`)."""
    return load_json(resolve(path) / MANIFEST)


# -- dense model and optimizer ------------------------------------------------------------

def _save_tensor(folder: Path, file: str, tensor: torch.Tensor) -> dict:
    import torch

    tensor = tensor.detach().cpu()
    dtype = str(tensor.dtype)
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        tensor = tensor.float()
    save_array(folder / file, tensor.numpy())
    return {"file": file, "dtype": dtype}


def _load_tensor(folder: Path, entry: dict) -> torch.Tensor:
    import torch

    name = entry["dtype"].removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unsupported tensor dtype {entry['dtype']!r} in {folder}")
    file = check_name(entry["file"], f"{folder}: tensor file")
    return torch.from_numpy(np.array(load_array(folder / file))).to(dtype)


def save_tensors(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write named tensors as ``<name>-<i>.npy`` plus ``<name>.json`` (names, dtypes)."""
    entries = [{"name": key, **_save_tensor(folder, f"{name}-{i}.npy", t)}
               for i, (key, t) in enumerate(tensors.items())]
    save_json(folder / f"{name}.json", {"tensors": entries})


def load_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    entries = load_json(folder / f"{name}.json")["tensors"]
    return {e["name"]: _load_tensor(folder, e) for e in entries}


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return {"__tuple__": isinstance(value, tuple),
                "items": [_to_json(v, where) for v in value]}
    raise CheckpointError(f"{where}: cannot store a {type(value).__name__} in a checkpoint")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        items = [_from_json(v) for v in value["items"]]
        return tuple(items) if value["__tuple__"] else items
    return value


def save_optimizer(folder: Path, name: str, optimizer: torch.optim.Optimizer) -> None:
    """Flatten ``optimizer.state_dict()``: tensors to ``.npy``, the rest to ``<name>.json``."""
    import torch

    state_dict = optimizer.state_dict()
    state, count = {}, 0
    for param_id, param_state in state_dict["state"].items():
        entry = {}
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                entry[key] = {"tensor": _save_tensor(folder, f"{name}-{count}.npy", value)}
                count += 1
            else:
                entry[key] = {"value": _to_json(value, f"{name} state {param_id}.{key}")}
        state[str(param_id)] = entry
    groups = [{k: _to_json(v, f"{name} param group {k}") for k, v in g.items()}
              for g in state_dict["param_groups"]]
    save_json(folder / f"{name}.json", {"state": state, "param_groups": groups})


def load_optimizer(folder: Path, name: str, optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(read_optimizer(folder, name))


def read_optimizer(folder: Path, name: str) -> dict:
    """The optimizer ``state_dict()`` that :func:`save_optimizer` wrote (ids as keys)."""
    data = load_json(folder / f"{name}.json")
    state = {}
    for param_id, entry in data["state"].items():
        state[int(param_id)] = {
            key: (_load_tensor(folder, v["tensor"]) if "tensor" in v else _from_json(v["value"]))
            for key, v in entry.items()
        }
    groups = [{k: _from_json(v) for k, v in g.items()} for g in data["param_groups"]]
    return {"state": state, "param_groups": groups}
