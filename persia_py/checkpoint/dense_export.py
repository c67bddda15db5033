"""Versions of the dense model pushed from training to serving, and a serving process
that swaps each new one in atomically.

Monolith's lesson: embeddings change every step and are pushed often (incremental
exports, :mod:`persia_py.servers.increments`); the dense tower changes slowly and is
pushed on its own, rarer interval. With ``checkpoint_config.dense_export_dir`` and
``dense_export_every_steps`` and/or ``dense_export_every_sec`` set, rank 0 of a training
job writes the dense model's ``state_dict`` as a *version*::

    DIR/dense-<seq:012d>-<id>/
      manifest.json            # written last: format, seq, step, created_unix
      dense-model.json         # names, dtypes, files (as a checkpoint's dense-model)
      dense-model-<i>.npy

Crash-safe like a checkpoint: into ``DIR/tmp-<uuid>``, every file fsync'd, manifest
last, then renamed; the newest ``KEEP_VERSIONS`` are kept. Writing happens on a thread
of its own from a copy of the weights taken at the step, so training waits only for the
copy; if a write is still going when the next version is due, the newer copy replaces
the waiting one (each version is a whole model: skipping one loses nothing).

A serving process (:class:`DenseFollower`) polls DIR; for a version newer than the
model it answers with, it builds a fresh model with the user's factory, reads the
arrays memory-mapped and checks each against the model's own names, dtypes and shapes
(so nothing is allocated from sizes read off disk), refuses non-finite values, loads
them, and only then swaps the reference that requests read under a lock: a request sees
the old model or the new one, never one half loaded. Nothing is unpickled.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from persia_py.checkpoint import layout as fmt
from persia_py.config import CheckpointConfig, ConfigError
from persia_py.ops import safe_files
from persia_py.ops.background import BackgroundWorker, Follower, LagWarning, Outage

logger = logging.getLogger(__name__)

DENSE_EXPORT_FORMAT = "persia_py-dense-export"
KEEP_VERSIONS = 3
"""Versions kept in the export folder (the newest); older ones are removed."""
FOLLOW_POLL_SEC = 0.5
"""How often a serving process looks for a new dense version."""
_NAME = re.compile(r"dense-(\d{12})-[0-9a-f]{8}")
_TENSORS = "dense-model"


def dense_versions(directory: str | Path) -> list[tuple[int, Path]]:
    """Complete versions in ``directory`` as (seq, folder), oldest first (links skipped)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), Path(e.path)) for e in entries
                  if (m := _NAME.fullmatch(e.name)) and e.is_dir(follow_symlinks=False))


def write_dense_version(directory: str | Path, seq: int, tensors: dict[str, torch.Tensor],
                        *, step: int, keep: int | None = KEEP_VERSIONS) -> Path:
    """Write ``tensors`` (a model's ``state_dict``) as version ``seq`` into ``directory``
    (created if missing); returns its folder. Versions older than the newest ``keep`` go
    (None: every version stays, e.g. to replay a stream)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        fmt.save_tensors(tmp, _TENSORS, tensors)
        safe_files.save_json(tmp / fmt.MANIFEST, {
            "format": DENSE_EXPORT_FORMAT, "version": fmt.VERSION, "seq": int(seq),
            "step": int(step), "created_unix": time.time()})
        safe_files.fsync_dir(tmp)
        final = directory / f"dense-{seq:012d}-{uuid.uuid4().hex[:8]}"
        os.rename(tmp, final)
        safe_files.fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in (dense_versions(directory)[:-keep] if keep else []):
        shutil.rmtree(old, ignore_errors=True)
    return final


def _created_unix(manifest: dict, where: str) -> float:
    created = manifest.get("created_unix")
    if (isinstance(created, bool) or not isinstance(created, (int, float))
            or not math.isfinite(created)):
        raise safe_files.CheckpointError(f"{where}: 'created_unix' must be a finite number")
    return float(created)


def read_dense_version(folder: str | Path, expected: dict[str, torch.Tensor]
                       ) -> tuple[dict[str, torch.Tensor], dict]:
    """The state dict of version ``folder`` and its manifest, checked against
    ``expected`` (the state dict of a freshly built model): the same names, dtypes and
    shapes, finite floating values. CheckpointError says what and where."""
    where = os.fspath(folder)
    with safe_files.opened_dir(None, folder) as fd:
        manifest = fmt.check_manifest(safe_files.load_json_at(fd, fmt.MANIFEST), where,
                                      DENSE_EXPORT_FORMAT)
        _created_unix(manifest, where)
        described = safe_files.load_json_at(fd, f"{_TENSORS}.json")
        entries = described.get("tensors") if isinstance(described, dict) else None
        if not isinstance(entries, list) or not all(
                isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
            raise safe_files.CheckpointError(f"{where}/{_TENSORS}.json: 'tensors' must list "
                                      "{'name', 'dtype', 'file'} entries")
        names = [e["name"] for e in entries]
        if sorted(names) != sorted(expected):
            missing, extra = set(expected) - set(names), set(names) - set(expected)
            raise safe_files.CheckpointError(
                f"{where}: tensors do not match the model's (missing {sorted(missing)[:5]}, "
                f"unknown {sorted(extra)[:5]}, {len(names) - len(set(names))} repeated)")
        out = {}
        for entry in entries:
            name, want = entry["name"], expected[entry["name"]]
            at = f"{where}: tensor {name!r}"
            if entry.get("dtype") != str(want.dtype):
                raise safe_files.CheckpointError(f"{at}: dtype {entry.get('dtype')!r}, the model's "
                                          f"is {want.dtype}")
            file = safe_files.check_name(entry.get("file"), f"{at}: file")
            array = safe_files.load_array_at(fd, file, mmap=True)  # not read before the check
            if array.shape != tuple(want.shape):
                raise safe_files.CheckpointError(f"{at}: shape {array.shape}, the model's is "
                                          f"{tuple(want.shape)}")
            tensor = torch.from_numpy(np.array(array)).to(want.dtype)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise safe_files.CheckpointError(f"{at}: NaN or infinite values")
            out[name] = tensor
    return out, manifest


class DenseExporter(BackgroundWorker):
    """Writes versions of a training model into ``directory`` every ``every_steps``
    steps and/or ``every_sec`` seconds (rank 0 of a DDP or one-rank job calls
    :meth:`after_step` after each step). ``on_failure`` is called on every failed write
    (retried at the next version; a later version holds everything anyway)."""

    def __init__(self, directory: str | Path, *, every_steps: int = 0, every_sec: float = 0.0,
                 keep: int | None = KEEP_VERSIONS,
                 on_failure: Callable[[], None] | None = None) -> None:
        if not (every_steps or every_sec):
            raise ValueError("set every_steps or every_sec (> 0)")
        if keep is not None and keep < 1:
            raise ValueError(f"keep: expected None or >= 1 versions, got {keep}")
        super().__init__("dense-exporter")
        self.directory, self.keep = Path(directory), keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_steps, self.every_sec = every_steps, every_sec
        versions = dense_versions(self.directory)
        self.seq = versions[-1][0] if versions else 0
        """Sequence number of the last version handed to the writer."""
        self.num_written = 0
        self._steps = 0
        self._last_time = time.monotonic()
        self._cond = threading.Condition()
        self._waiting: tuple[int, int, dict[str, torch.Tensor]] | None = None
        self._writing = False
        self.outage = Outage(f"dense export to {self.directory}", on_failure)

    def after_step(self, model: torch.nn.Module) -> None:
        """Count a training step; export ``model`` if a version is due."""
        self._steps += 1
        due_steps = self.every_steps and self._steps % self.every_steps == 0
        due_time = self.every_sec and time.monotonic() - self._last_time >= self.every_sec
        if due_steps or due_time:
            self.export(model)

    def export(self, model: torch.nn.Module) -> int:
        """Hand a copy of ``model``'s weights to the writer now; returns its sequence
        number. Raises if the writer thread has died."""
        if self.error is not None:
            raise RuntimeError(f"dense exporter failed: {self.error}") from self.error
        self._last_time = time.monotonic()
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with self._cond:
            self.seq += 1
            self._waiting = (self.seq, self._steps, tensors)  # a newer copy replaces it
            self._cond.notify_all()
            return self.seq

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every version handed over is written (or failed)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._writing,
                                       timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._stop.is_set())
                if self._waiting is None:
                    return
                (seq, step, tensors), self._waiting = self._waiting, None
                self._writing = True
            try:
                self.outage.attempt(functools.partial(self._write, seq, step, tensors))
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, seq: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        final = write_dense_version(self.directory, seq, tensors, step=step, keep=self.keep)
        self.num_written += 1
        logger.info("dense model version %d (step %d) exported to %s", seq, step, final)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is waiting, then stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        super().close(timeout)


def check_dense_export(config: CheckpointConfig, *, sharded: bool) -> None:
    """ConfigError if ``checkpoint_config.dense_export_*`` asks for exports of a sharded
    (FSDP) model: no rank holds it whole."""
    if sharded and (config.dense_export_every_steps or config.dense_export_every_sec):
        raise ConfigError("checkpoint_config.dense_export_dir: dense exports for serving need "
                          "a whole model on rank 0 (DDPOption or one rank); under FSDPOption "
                          "serve from checkpoints instead")


def dense_exporter_for(config: CheckpointConfig, *, rank: int,
                       sharded: bool) -> DenseExporter | None:
    """The started exporter ``checkpoint_config.dense_export_*`` asks for, on rank 0
    (every DDP rank holds the whole model; rank 0 alone writes it); None if not asked or
    on another rank. A sharded (FSDP) model is refused (:func:`check_dense_export`)."""
    check_dense_export(config, sharded=sharded)
    if not (config.dense_export_every_steps or config.dense_export_every_sec):
        return None
    if rank != 0:
        return None
    assert config.dense_export_dir is not None, "CheckpointConfig requires it with either"
    return DenseExporter(config.dense_export_dir, every_steps=config.dense_export_every_steps,
                         every_sec=config.dense_export_every_sec).start()


class DenseModelSlot:
    """The dense model a serving process answers with, swapped whole under a lock."""

    def __init__(self, model: torch.nn.Module, *, version: int = 0,
                 created_unix: float | None = None) -> None:
        self._lock = threading.Lock()
        self._current = (model, version, time.time() if created_unix is None else created_unix)

    def current(self) -> tuple[torch.nn.Module, int]:
        """The model to answer one request with, and its version (0: the checkpoint's)."""
        with self._lock:
            return self._current[0], self._current[1]

    def swap(self, model: torch.nn.Module, version: int, created_unix: float) -> None:
        with self._lock:
            self._current = (model, version, created_unix)

    @property
    def created_unix(self) -> float:
        with self._lock:
            return self._current[2]


class DenseFollower(Follower):
    """Loads every newer dense version in ``directory`` and swaps it into ``slot``.

    ``build``: makes a fresh model (the user's factory, on the serving device), whose
    state dict is what a version must match. A version that cannot be loaded is retried
    with backoff (logged once, counted by ``on_failure``); the slot keeps serving the
    model it has. ``warn_after_sec``: log a WARNING when the model in the slot gets
    older than this (None: never).
    """

    def __init__(self, slot: DenseModelSlot, directory: str | Path,
                 build: Callable[[], torch.nn.Module], *, poll_sec: float = FOLLOW_POLL_SEC,
                 on_failure: Callable[[], None] | None = None,
                 warn_after_sec: float | None = None) -> None:
        super().__init__("dense-follower", poll_sec,
                         Outage(f"loading dense versions from {directory}", on_failure),
                         LagWarning("the dense model being served", warn_after_sec))
        self.slot, self.directory, self.build = slot, Path(directory), build
        self.num_loaded = 0
        self._seen = slot.current()[1]

    def age_sec(self) -> float:
        """Seconds since the model in the slot was written."""
        return max(0.0, time.time() - self.slot.created_unix)

    def poll_once(self) -> bool:
        """Swap in the newest version if it is newer than the slot's; True if swapped."""
        versions = dense_versions(self.directory)
        if not versions or versions[-1][0] <= self._seen:
            return False
        seq, folder = versions[-1]
        model = self.build()
        state, manifest = read_dense_version(folder, model.state_dict())
        created = _created_unix(manifest, os.fspath(folder))
        self._seen = seq
        if created <= self.slot.created_unix:  # older than what is served (a checkpoint)
            return False
        model.load_state_dict(state, strict=True)
        self.slot.swap(model.eval(), seq, created)
        self.num_loaded += 1
        logger.info("dense model version %d (training step %s) swapped in", seq,
                    manifest.get("step"))
        return True


__all__ = ["DenseExporter", "DenseFollower", "DenseModelSlot", "dense_versions",
           "read_dense_version", "write_dense_version"]
