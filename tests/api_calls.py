"""Small, valid pieces of persia_py's public API for the tests that call it wrongly
(:mod:`test_faq_errors`, :mod:`test_api_argument_checks`): a model, batches, a
:class:`TrainCtx` around them, a parameter server and an embedding worker serving slots
``user`` and ``item`` (:func:`serving_cluster`), and :func:`raised` for what a call
raises."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from child_processes import start_server

from persia_py.config import CommonConfig, GlobalConfig
from persia_py.ctx import TrainCtx
from persia_py.data import IterableDataset
from persia_py.embedding.data import (
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import SGD
from persia_py.env import PersiaEnv

COMMON = CommonConfig(rpc_timeout_sec=30, startup_timeout_sec=60)
GLOBAL = GlobalConfig(common_config=COMMON)
EMBEDDING_CONFIG = "slots_config:\n  user:\n    dim: 2\n  item:\n    dim: 2\n"


@dataclass(frozen=True)
class Cluster:
    embedding_worker: str


@contextmanager
def serving_cluster(root: Path) -> Iterator[Cluster]:
    """A parameter server and an embedding worker serving slots ``user`` and ``item``
    (their config written into ``root``), stopped when the ``with`` ends."""
    (root / "embedding_config.yml").write_text(EMBEDDING_CONFIG)
    config = ["--embedding-config", str(root / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *config)
    try:
        ew, ew_port = start_server("embedding-worker", *config,
                                   "--ps-addrs", f"127.0.0.1:{ps_port}")
        try:
            yield Cluster(f"127.0.0.1:{ew_port}")
        finally:
            ew.stop()
    finally:
        ps.stop()


def model() -> torch.nn.Module:
    return torch.nn.Linear(6, 1)


def single(slot: str, ids) -> IDTypeFeatureWithSingleID:
    return IDTypeFeatureWithSingleID(slot, np.asarray(ids, dtype=np.uint64))


def batch(slots=("user", "item"), requires_grad: bool = True) -> PersiaBatch:
    return PersiaBatch([single(s, [1, 2]) for s in slots],
                       non_id_type_features=[NonIDTypeFeature(np.zeros((2, 2), np.float32))],
                       labels=[Label(np.zeros((2, 1), np.float32))],
                       requires_grad=requires_grad)


def train_ctx(cluster: Cluster | None = None, **kwargs) -> TrainCtx:
    m = kwargs.pop("model", None) or model()
    params = (m if isinstance(m, torch.nn.Module) else model()).parameters()
    args = dict(model=m, embedding_optimizer=SGD(lr=0.1),
                dense_optimizer=torch.optim.SGD(params, lr=0.1), global_config=GLOBAL,
                env=PersiaEnv(embedding_worker_addrs=(cluster.embedding_worker,) if cluster
                              else ()))
    return TrainCtx(**{**args, **kwargs})


def raised(call: Callable[[], object]) -> BaseException:
    """The exception ``call`` raises; fails the test if it returns."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - SystemExit is one of the listed errors
        return exc
    raise AssertionError("no error was raised")


class Empty(IterableDataset):
    """A dataset of no samples (what a dataset's own checks see)."""

    def __iter__(self):
        return iter(())

