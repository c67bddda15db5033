"""The sharded dense state of an FSDP job, in ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards of the dense model and optimizer state; DCP's planner
decides who writes what and, on load, which bytes of which file each rank reads, so a
checkpoint taken with N ranks loads with M, and into an unsharded (DDP) model.

**No pickle.** DCP's own file storage pickles its metadata and ``torch.save``s every
tensor; this module gives DCP a storage layer of its own instead: each rank's tensors go
raw (their bytes, C order) into ``dense-shard-<rank>.bin``, and the metadata (names,
dtypes, shapes, chunks, and where each chunk lies) into ``dense-dcp.json``. Only
tensors are accepted; the optimizer's param groups and other plain values go to
``dense-sharded.json``. Files are created new and fsync'd like the rest of the
checkpoint (:mod:`persia_py.checkpoint.layout`), in the folder the Checkpointer commits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from persia_py.checkpoint import layout as fmt
from persia_py.ops import safe_files

DCP_METADATA = fmt.DCP_METADATA
"""DCP's metadata, as JSON."""
SHARDED_STATE = "dense-sharded.json"
"""Optimizer param groups and plain (non-tensor) optimizer values."""
DCP_FORMAT = "persia_py-dcp"


def _shard_file(rank: int) -> str:
    return f"dense-shard-{rank}.bin"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise safe_files.CheckpointError(f"{DCP_METADATA}: unsupported dtype {name!r}")
    return dtype


def _key(fqn: str, offset) -> tuple:
    return (fqn, None if offset is None else tuple(int(o) for o in offset))


class JsonStorageWriter(StorageWriter):
    """DCP storage: raw tensor bytes per rank, metadata as JSON (see the module doc)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.rank = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.rank = kwargs.get("rank") or (dist.get_rank() if dist.is_initialized() else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = _shard_file(self.rank)
        results = []
        with open(self.folder / safe_files.check_name(name, "shard file"), "xb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise safe_files.CheckpointError(
                        f"{item.index.fqn}: only tensors go into a sharded dense checkpoint "
                        "(no pickled objects)")
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor), "a TENSOR write item resolves to one"
                tensor = data.detach().contiguous().cpu()
                raw = tensor.reshape(-1).view(torch.uint8).numpy()
                start = f.tell()
                f.write(raw.data)
                results.append(WriteResult(
                    index=item.index, size_in_bytes=raw.nbytes,
                    storage_data={"file": name, "start": start, "length": raw.nbytes,
                                  "sizes": list(tensor.shape)}))
            f.flush()
            os.fsync(f.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise safe_files.CheckpointError(f"{fqn}: only tensors go into a sharded checkpoint")
            tensors[fqn] = {"dtype": str(md.properties.dtype).removeprefix("torch."),
                            "size": list(md.size),
                            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)}
                                       for c in md.chunks]}
        storage = [{"fqn": r.index.fqn,
                    "offset": None if r.index.offset is None else list(r.index.offset),
                    "index": r.index.index, **r.storage_data}
                   for rank_results in results for r in rank_results]
        safe_files.save_json(self.folder / DCP_METADATA, {"format": DCP_FORMAT, "version": 1,
                                                   "tensors": tensors, "storage": storage})

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class JsonStorageReader(StorageReader):
    """Reads what :class:`JsonStorageWriter` wrote, without unpickling anything."""

    def __init__(self, folder: str | os.PathLike) -> None:
        super().__init__()
        self.folder = Path(folder)
        self._storage: dict[tuple, dict] = {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        data = fmt.check_manifest(safe_files.load_json(self.folder / DCP_METADATA),
                                  str(self.folder / DCP_METADATA), kind=DCP_FORMAT)
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, t in data["tensors"].items():
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(t["dtype"])),
                size=torch.Size(t["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                             sizes=torch.Size(c["sizes"])) for c in t["chunks"]])
        storage = {}
        for s in data["storage"]:
            index = MetadataIndex(fqn=s["fqn"], index=s["index"],
                                  offset=None if s["offset"] is None else torch.Size(s["offset"]))
            storage[index] = {k: s[k] for k in ("file", "start", "length", "sizes")}
        return Metadata(state_dict_metadata=state, storage_data=storage,
                        storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args,
                              **kwargs) -> None:
        self._storage = {_key(i.fqn, i.offset): v for i, v in metadata.storage_data.items()}
        self._dtypes = {fqn: _tensor_metadata(fqn, md).properties.dtype
                        for fqn, md in metadata.state_dict_metadata.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            entry = self._storage[_key(item.storage_index.fqn, item.storage_index.offset)]
            by_file.setdefault(safe_files.check_name(entry["file"], "shard file"), []).append(
                (item, entry))
        for name, items in by_file.items():
            with safe_files.opened_dir(None, self.folder) as dir_fd:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                for item, entry in items:
                    f.seek(entry["start"])
                    raw = bytearray(f.read(entry["length"]))
                    if len(raw) != entry["length"]:
                        raise safe_files.CheckpointError(f"{name}: truncated ({item.storage_index.fqn})")
                    dtype = self._dtypes[item.storage_index.fqn]
                    chunk = (torch.frombuffer(raw, dtype=dtype) if raw else
                             torch.empty(0, dtype=dtype)).reshape(entry["sizes"])
                    for dim, (start, length) in enumerate(zip(item.storage_offsets,
                                                              item.lengths)):
                        chunk = chunk.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(chunk)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


# -- the dense state ------------------------------------------------------------------------


def _optimizer_state(optim_sd: Mapping[str, object]) -> dict[str, dict[str, Any]]:
    """``optim_sd["state"]`` of ``get_state_dict``: parameter FQN -> its state (torch
    types each value of an optimizer state dict as a dict or a list of dicts)."""
    return cast(dict[str, dict[str, Any]], optim_sd["state"])


def _tensor_metadata(fqn: str, md: TensorStorageMetadata | BytesStorageMetadata
                     ) -> TensorStorageMetadata:
    """``md``, which :class:`JsonStorageReader` makes for tensors only."""
    assert isinstance(md, TensorStorageMetadata), f"{fqn}: not a tensor's metadata"
    return md


def _split_optimizer_state(state: dict) -> tuple[dict, dict]:
    tensors, plain = {}, {}
    for fqn, entry in state.items():
        tensors[fqn] = {k: v for k, v in entry.items() if torch.is_tensor(v)}
        plain[fqn] = {k: fmt._to_json(v, f"optimizer state {fqn}.{k}")
                      for k, v in entry.items() if not torch.is_tensor(v)}
    return tensors, plain


def save_sharded(folder: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Every rank: write its shards of ``model`` and ``optimizer`` into ``folder`` (which
    every rank sees); rank 0 writes the metadata. A collective."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors, plain = _split_optimizer_state(_optimizer_state(optim_sd))
    dcp.save({"model": model_sd, "optim": tensors},
             storage_writer=JsonStorageWriter(folder), no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank() == 0:
        groups = [{k: fmt._to_json(v, f"param group {k}") for k, v in g.items()}
                  for g in cast(list[dict[str, Any]], optim_sd["param_groups"])]
        safe_files.save_json(Path(folder) / SHARDED_STATE, {"param_groups": groups, "plain": plain})


def load_sharded(folder: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load a sharded dense state into ``model`` and ``optimizer``, whatever
    the number of ranks that wrote it and whether ``model`` is sharded or whole."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors, _ = _split_optimizer_state(_optimizer_state(optim_sd))
    dcp.load({"model": model_sd, "optim": tensors},
             storage_reader=JsonStorageReader(folder), no_dist=not dist.is_initialized())
    extra = safe_files.load_json(Path(folder) / SHARDED_STATE)
    state: dict[str, Any] = {fqn: {**tensors.get(fqn, {}),
                                   **{k: fmt._from_json(v) for k, v in values.items()}}
                             for fqn, values in extra["plain"].items()}
    groups = [{k: fmt._from_json(v) for k, v in g.items()} for g in extra["param_groups"]]
    set_state_dict(model, optimizer, model_state_dict=model_sd,
                   optim_state_dict={"state": state, "param_groups": groups})


def load_full_into_sharded(folder: str | os.PathLike, model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer) -> None:
    """Every rank: load the whole-model format (rank 0's ``dense-model`` and
    ``dense-optimizer`` files, as a DDP job writes them) into a sharded ``model``; each
    rank keeps its shard."""
    folder = Path(folder)
    full = StateDictOptions(full_state_dict=True)
    whole: dict[str, Any] = fmt.load_tensors(folder, "dense-model")
    set_model_state_dict(model, whole, options=full)
    saved = fmt.read_optimizer(folder, "dense-optimizer")
    # torch numbers the optimizer's parameters in param-group order; name them by FQN.
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {fqns[i]: entry for i, entry in saved["state"].items()}
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=full)


def read_full_model(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole dense model of a checkpoint folder, sharded or not, read in this process
    alone (no process group): e.g. for serving, or to compare two checkpoints."""
    folder = Path(folder)
    if not fmt.is_sharded(folder):
        return fmt.load_tensors(folder, "dense-model")
    metadata = JsonStorageReader(folder).read_metadata()
    tensors = {fqn: _tensor_metadata(fqn, md) for fqn, md in metadata.state_dict_metadata.items()
               if fqn.startswith("model.")}
    out = {fqn.removeprefix("model."): torch.empty(tuple(md.size), dtype=md.properties.dtype)
           for fqn, md in tensors.items()}
    dcp.load({"model": out}, storage_reader=JsonStorageReader(folder), no_dist=True)
    return out

