"""Self-healing of a ``persia-launcher local`` job: when an NN rank dies, the job's
training restarts from its last checkpoint. (A parameter server (its update log
replayed), an embedding worker (the data loaders put its batches there again) or a data
loader (its handover log) is restarted alone: see ``Role.restart`` in
persia_py/launcher/local.py; this class is called for a role without one.)

What a dead rank held is not in any other process (the dense model and its optimizer),
so the training side rolls back to one consistent cut: the embedding workers, data
loaders and NN workers are stopped and started again; the NN workers load the newest
checkpoint of ``checkpoint_config.dir`` by themselves (``TrainCtx``; the parameter
servers' rows and exactly-once windows included, all or nothing) and every data loader
skips exactly the batches of its own the checkpoint holds as trained
(``$PERSIA_DATA_POSITIONS``). Without a checkpoint the parameter servers restart empty
too, and training starts over. Every batch is thus trained exactly once between the last
restore and the end; what was trained after the checkpoint is trained again. Each role
restarts at most ``max_restarts`` times; each restart is logged, and recorded in the
training log.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from persia_py.env import ENV_GLOBAL_CONFIG
from persia_py.ids.positions import ENV_DATA_POSITIONS
from persia_py.ops import safe_files
from persia_py.telemetry.events import Event, emit, read_events


def resume_env(path: str) -> dict[str, str]:
    """Environment that makes a job continue from the checkpoint ``path`` names: the NN
    workers load it, each data loader skips the batches of its own it holds as trained."""
    from persia_py.checkpoint import layout as checkpoint_format
    from persia_py.ids.positions import DataPositions

    try:
        folder = checkpoint_format.resolve(path)
    except safe_files.CheckpointError as exc:
        raise SystemExit(f"--resume: {exc}") from None
    manifest = safe_files.load_json(folder / checkpoint_format.MANIFEST)
    positions = DataPositions.from_json(checkpoint_format.data_positions(manifest),
                                        f"{folder} data_positions")
    print(f"[launcher] resuming from {folder} ({manifest['step']} batches trained)",
          flush=True)
    return {checkpoint_format.ENV_RESUME_DIR: str(folder), ENV_DATA_POSITIONS: positions.to_text()}


def checkpoint_root(env: dict[str, str], resume: str | None) -> str | None:
    """Where the job's checkpoints are: ``checkpoint_config.dir``, else ``--resume``."""
    from persia_py.config import load_global_config

    root = load_global_config(env.get(ENV_GLOBAL_CONFIG)).checkpoint_config.dir
    return root or resume


def latest_checkpoint(root: str | None) -> str | None:
    """The newest complete checkpoint under ``root`` (None: there is none yet)."""
    from persia_py.checkpoint import layout as checkpoint_format

    found = checkpoint_format.latest(root) if root is not None else None
    return None if found is None else str(found)


class TrainingRecovery:
    """``LocalCluster.restart_training``: restarts the training side from the newest
    checkpoint in ``root`` (see the module docstring)."""

    def __init__(self, cluster, *, servers: list, training: list, root: str | None,
                 train_log: str, max_restarts: int,
                 log: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.servers = servers
        self.training = training
        self.root = root
        self.train_log = train_log
        self.max_restarts = max_restarts
        self.log = log
        self.restarts: list[tuple[str, str]] = []

    def __call__(self, role, how: str) -> bool:
        if role.num_restarts >= self.max_restarts:
            self.log(f"{role.name} died ({how}) after {role.num_restarts} restarts, the "
                     "limit; stopping the job")
            return False
        role.num_restarts += 1
        self.cluster.count_restart(role)
        self.restarts.append((role.name, how))
        latest = latest_checkpoint(self.root)
        self.log(f"{role.name} died ({how}); restarting the training "
                 + (f"from checkpoint {latest}" if latest else
                    "from the start (no checkpoint yet; the parameter servers too)")
                 + f": embedding workers, data loaders, NN workers (restart "
                 f"{role.num_restarts} of {self.max_restarts} for {role.name})")
        self._record(role.name, how, latest)
        self.cluster.stop(self.training)
        restarted = list(self.training)
        if latest is None:
            self.cluster.stop(self.servers)
            restarted = self.servers + restarted
        from persia_py.checkpoint.layout import ENV_RESUME_DIR

        env = self.cluster.env
        for key in (ENV_RESUME_DIR, ENV_DATA_POSITIONS):  # the newest checkpoint decides
            env.pop(key, None)
        if latest is not None:
            env.update(resume_env(latest))
        for r in restarted:
            self.cluster.spawn(r, r.command)
        return True

    def _record(self, name: str, how: str, checkpoint: str | None) -> None:
        emit(Event.RESTART, to=self.train_log, role=name, reason=how, checkpoint=checkpoint)

    def summary(self) -> str | None:
        if not self.restarts:
            return None
        counts: dict[str, int] = {}
        for name, _ in self.restarts:
            counts[name] = counts.get(name, 0) + 1
        return ("restarts of the training: " + ", ".join(f"{n} {c}" for n, c in counts.items())
                + f" ({len(self.restarts)} in all)")


class BatchCounts:
    """What the job's batches went through, from the events its roles wrote to the
    training log (:mod:`persia_py.telemetry.events`): each loader's last run (batches sent,
    and skipped as trained before the checkpoint it resumed or handed over by its
    predecessor), batches re-sent to restarted embedding workers, and torchrun's restarts
    of the NN ranks. ``persia-launcher local`` ends with it."""

    def __init__(self, train_log: str | os.PathLike) -> None:
        self.train_log = train_log

    def summary(self) -> str | None:
        sent: dict[int, tuple[int, int]] = {}
        counts = dict.fromkeys((Event.BATCH_RESENT, Event.TRAINING_REWOUND), 0)
        for record in read_events(self.train_log):
            kind = record["event"]
            if kind == Event.LOADER_FINISHED:  # a restarted loader's last run replaces one
                sent[int(record["loader"])] = (int(record["sent"]), int(record["skipped"]))
            elif kind in counts:
                counts[kind] += 1
        if not sent:
            return None
        rewinds = counts[Event.TRAINING_REWOUND]
        return (f"batches: {sum(s for s, _ in sent.values())} sent by the data loaders' last "
                f"runs ({sum(k for _, k in sent.values())} skipped: trained before the "
                "checkpoint they resumed, or handed over before they restarted), "
                f"{counts[Event.BATCH_RESENT]} re-sent to restarted embedding workers"
                + (f"; torchrun restarts of the NN ranks: {rewinds} (each went back to its "
                   "checkpoint)" if rewinds else ""))
