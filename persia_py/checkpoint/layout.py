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
``allow_pickle=False``); every description is JSON. Nothing is pickled. A parameter
server's table files over one chunk have their header padded to 4096 bytes (written and
read in aligned chunks past the page cache), and ``ps-<r>.json`` holds a checksum of each
(``persia_py.servers.array_files``, ``persia_py.servers.table_files``).

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
names read from a checkpoint's JSON must be plain names (:func:`safe_files.check_name`), so a
crafted checkpoint or a planted link cannot reach outside the checkpoint's folder.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from persia_py.ops import safe_files

if TYPE_CHECKING:  # torch is imported by the dense functions only: servers never need it
    import torch

FORMAT = "persia_py-checkpoint"
VERSION = 1
ENV_RESUME_DIR = "PERSIA_RESUME_DIR"
"""A checkpoint (root or folder) that ``TrainCtx`` loads on entry."""
MANIFEST = "manifest.json"
LATEST = "LATEST"
DCP_METADATA = "dense-dcp.json"
"""Index of an FSDP job's sharded dense state (:mod:`persia_py.checkpoint.dense`)."""
_KEEP = 2
"""Complete checkpoints kept in a root (the newest ones); older ones are removed."""


def is_sharded(folder: str | os.PathLike) -> bool:
    """Whether the checkpoint folder holds a sharded (DCP) dense state. Here, not in
    :mod:`persia_py.checkpoint.dense`: importing ``torch.distributed.checkpoint`` costs a
    rank's start about a second of CPU, which a job without FSDP need not pay."""
    return (Path(folder) / DCP_METADATA).is_file()


# -- the root: temporary folders, commit, LATEST --------------------------------------------

def new_tmp_dir(root: str | os.PathLike, token: str | None = None) -> Path:
    """Create ``ROOT/tmp-<token>`` (a fresh uuid by default) for a checkpoint being written."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{safe_files.TMP_PREFIX}{token or uuid.uuid4().hex}"
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
    safe_files.save_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": step,
                               "written_as": tmp.name, **manifest})
    safe_files.fsync_dir(tmp)
    final = root / f"ckpt-{step:012d}-{uuid.uuid4().hex[:8]}"
    os.rename(tmp, final)
    safe_files.fsync_dir(root)
    pointer = root / f"{safe_files.TMP_PREFIX}{uuid.uuid4().hex}.latest"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    safe_files.fsync_dir(root)
    _prune(root, keep=final.name)
    return final


def _prune(root: Path, keep: str) -> None:
    """Remove leftover temporaries and all but the newest ``_KEEP`` checkpoints."""
    complete = sorted((p for p in root.iterdir() if p.name.startswith("ckpt-") and p.is_dir()),
                      key=lambda p: p.stat().st_mtime_ns)
    old = [p for p in complete[:-_KEEP] if p.name != keep]
    for path in old + [p for p in root.iterdir() if p.name.startswith(safe_files.TMP_PREFIX)]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class NoCheckpointYet(safe_files.CheckpointError):
    """:func:`resolve`'s error for a path that holds no checkpoint at all, as a root does
    before its first checkpoint is complete: the folder does not exist, or holds neither
    ``LATEST`` nor a checkpoint's own files (a ``tmp-*`` folder being written may be
    there). A folder with a checkpoint's files but no manifest is a torn checkpoint: a
    plain :class:`safe_files.CheckpointError`."""


def _holds_checkpoint_files(folder: Path) -> bool:
    """Whether ``folder`` itself holds a checkpoint's files (``.json``, ``.npy``)."""
    return any(entry.is_file() and entry.suffix in (".json", ".npy")
               for entry in folder.iterdir())


def resolve(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder that ``path`` names.

    ``path`` is a checkpoint root (its ``LATEST`` is followed) or one checkpoint folder.
    Raises :class:`NoCheckpointYet` where ``path`` holds no checkpoint yet, and
    :class:`safe_files.CheckpointError` unless the folder has a manifest of this format.
    """
    path = Path(path)
    if not path.exists():
        raise NoCheckpointYet(f"{path} does not exist")
    if not path.is_dir():
        raise safe_files.CheckpointError(f"{path} is not a folder")
    if (path / LATEST).is_file():
        path = path / safe_files.check_name((path / LATEST).read_text().strip(), f"{path / LATEST}")
    elif not (path / MANIFEST).is_file() and not _holds_checkpoint_files(path):
        raise NoCheckpointYet(f"{path} holds no checkpoint yet (no {LATEST}, no {MANIFEST})")
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise safe_files.CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}; an "
                              "interrupted write leaves none)")
    check_manifest(safe_files.load_json(manifest), str(manifest))
    return path


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``root`` (or ``root`` itself, if it is one);
    None: none there yet."""
    try:
        return resolve(root)
    except safe_files.CheckpointError:
        return None


def check_manifest(data: Any, where: str, kind: str = FORMAT) -> dict:
    """``data`` if it is a manifest of this ``kind`` and version; safe_files.CheckpointError if not."""
    if not isinstance(data, dict) or data.get("format") != kind or data.get("version") != VERSION:
        raise safe_files.CheckpointError(f"{where}: not a {kind} version {VERSION} manifest")
    return data



def names_in_root(root: Path, folder: str | os.PathLike, what: str) -> list[str]:
    """The names that lead from ``root`` to ``folder``: one (``ROOT/NAME``) or two
    (``ROOT/NAME/NAME``), each a plain name. Checkpoint calls carry these, never paths.
    safe_files.CheckpointError (naming ``what``) if ``folder`` lies elsewhere."""
    real = Path(os.path.realpath(folder))
    parts = real.relative_to(root).parts if real.is_relative_to(root) else ()
    if len(parts) not in (1, 2):
        raise safe_files.CheckpointError(
            f"{what}: {os.fspath(folder)!r} must lie directly in the checkpoint root {root} "
            f"or in a folder directly in it (ROOT/NAME or ROOT/NAME/NAME; set "
            f"checkpoint_config.root)")
    return [safe_files.check_name(part, what) for part in parts]


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint ``path`` names (see :func:`resolve`)."""
    return safe_files.load_json(resolve(path) / MANIFEST)


# -- dense model and optimizer ------------------------------------------------------------

def _save_tensor(folder: Path, file: str, tensor: torch.Tensor) -> dict:
    import torch

    tensor = tensor.detach().cpu()
    dtype = str(tensor.dtype)
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        tensor = tensor.float()
    safe_files.save_array(folder / file, tensor.numpy())
    return {"file": file, "dtype": dtype}


def _load_tensor(folder: Path, entry: dict) -> torch.Tensor:
    import torch

    name = entry["dtype"].removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise safe_files.CheckpointError(f"unsupported tensor dtype {entry['dtype']!r} in {folder}")
    file = safe_files.check_name(entry["file"], f"{folder}: tensor file")
    return torch.from_numpy(np.array(safe_files.load_array(folder / file))).to(dtype)


def save_tensors(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write named tensors as ``<name>-<i>.npy`` plus ``<name>.json`` (names, dtypes)."""
    entries = [{"name": key, **_save_tensor(folder, f"{name}-{i}.npy", t)}
               for i, (key, t) in enumerate(tensors.items())]
    safe_files.save_json(folder / f"{name}.json", {"tensors": entries})


def load_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    entries = safe_files.load_json(folder / f"{name}.json")["tensors"]
    return {e["name"]: _load_tensor(folder, e) for e in entries}


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return {"__tuple__": isinstance(value, tuple),
                "items": [_to_json(v, where) for v in value]}
    raise safe_files.CheckpointError(f"{where}: cannot store a {type(value).__name__} in a checkpoint")


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
    safe_files.save_json(folder / f"{name}.json", {"state": state, "param_groups": groups})


def load_optimizer(folder: Path, name: str, optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(read_optimizer(folder, name))


def read_optimizer(folder: Path, name: str) -> dict:
    """The optimizer ``state_dict()`` that :func:`save_optimizer` wrote (ids as keys)."""
    data = safe_files.load_json(folder / f"{name}.json")
    state = {}
    for param_id, entry in data["state"].items():
        state[int(param_id)] = {
            key: (_load_tensor(folder, v["tensor"]) if "tensor" in v else _from_json(v["value"]))
            for key, v in entry.items()
        }
    groups = [{k: _from_json(v) for k, v in g.items()} for g in data["param_groups"]]
    return {"state": state, "param_groups": groups}


def data_positions(manifest: Mapping) -> dict:
    """A checkpoint's data positions (JSON). A checkpoint written before they were kept
    has only batch counts: exact with one data loader (its first ``step`` batches)."""
    if "data_positions" in manifest:
        return manifest["data_positions"]
    return {"0": {"next": int(manifest["step"]), "also": []}}
