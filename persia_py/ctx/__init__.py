"""Contexts of the user's processes (as PERSIA's ``persia.ctx``).

* :class:`TrainCtx` — an NN worker that trains: DDP over the dense tower, embeddings
  looked up ahead within the ``embedding_staleness`` bound, gradients sent back.
* :func:`eval_ctx` / :class:`InferCtx` — forward only; lookups never insert rows.
* :class:`DataCtx` — a data-loader process (see :mod:`persia_py.workers.data_loader`).

The NN-side contexts are imported on first use: a data loader's ``from persia_py.ctx
import DataCtx`` then loads no torch, which would cost every loader start about a second
of CPU and a few hundred MB of memory it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from persia_py.workers.data_loader import DataCtx

if TYPE_CHECKING:
    from persia_py.ctx.embedding_ctx import EmbeddingCtx, current_ctx, eval_ctx
    from persia_py.ctx.infer_ctx import InferCtx
    from persia_py.ctx.train_ctx import TrainCtx

__all__ = ["DataCtx", "EmbeddingCtx", "InferCtx", "TrainCtx", "current_ctx", "eval_ctx"]

_LAZY = {"EmbeddingCtx": "embedding_ctx", "current_ctx": "embedding_ctx",
         "eval_ctx": "embedding_ctx", "InferCtx": "infer_ctx", "TrainCtx": "train_ctx"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
