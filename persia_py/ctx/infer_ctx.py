"""``InferCtx``: the context of an inference process (see :mod:`persia_py.ctx`)."""

from __future__ import annotations

import torch

from persia_py.config import GlobalConfig
from persia_py.ctx.embedding_ctx import (
    EmbeddingCtx,
    check_addresses,
)
from persia_py.env import PersiaEnv


class InferCtx(EmbeddingCtx):
    """Context of an inference process, e.g. a serving replica (as PERSIA's ``InferCtx``).

    Forward only: lookups never insert rows, training batches are refused, and the model
    is in eval mode inside the context (its mode is restored on exit).

    Args:
        embedding_worker_address_list: PERSIA's first argument: the embedding workers to
            look up in (default: ``PERSIA_EMBEDDING_WORKER_ADDRS``). ``embedding_worker_addresses``
            is the same, by this package's name; give at most one.
        model, global_config, device_id, env: as :class:`TrainCtx`.
    """

    _usage = "InferCtx(...)"

    def __init__(self, embedding_worker_address_list: list[str] | None = None, *,
                 model: torch.nn.Module | None = None,
                 embedding_worker_addresses: list[str] | None = None,
                 global_config: GlobalConfig | None = None, device_id: int | None = None,
                 env: PersiaEnv | None = None) -> None:
        if embedding_worker_address_list is not None and embedding_worker_addresses is not None:
            raise ValueError("give embedding_worker_address_list or embedding_worker_addresses, "
                             "not both")
        check_addresses("InferCtx(embedding_worker_address_list=...)",
                        embedding_worker_address_list)
        super().__init__(model=model, global_config=global_config, device_id=device_id, env=env,
                         embedding_worker_addresses=(embedding_worker_address_list
                                                     or embedding_worker_addresses))
        self._was_training: bool | None = None

    def __enter__(self) -> InferCtx:
        super().__enter__()
        if self.model is not None:
            self._was_training = self.model.training
            self.model.eval()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.model is not None and self._was_training is not None:
            self.model.train(self._was_training)
        super().__exit__(exc_type, exc, tb)

    def wait_for_serving(self) -> None:
        """PERSIA's wait until the embedding workers serve: entering this context already
        waited for each (``common_config.startup_timeout_sec``), so inside it this returns
        at once; outside it, RuntimeError."""
        if self._token is None:
            raise RuntimeError("wait_for_serving is called inside `with InferCtx(...)`, which "
                               "waits for the embedding workers on entry")
