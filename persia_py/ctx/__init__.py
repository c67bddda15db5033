"""Contexts of the user's processes (as PERSIA's ``persia.ctx``).

* :class:`TrainCtx` — an NN worker that trains: DDP over the dense tower, embeddings
  looked up ahead within the ``embedding_staleness`` bound, gradients sent back.
* :func:`eval_ctx` / :class:`InferCtx` — forward only; lookups never insert rows.
* :class:`DataCtx` — a data-loader process (see :mod:`persia_py.workers.data_loader`).
"""

from persia_py.ctx.embedding_ctx import EmbeddingCtx, current_ctx, eval_ctx
from persia_py.ctx.infer_ctx import InferCtx
from persia_py.ctx.train_ctx import TrainCtx
from persia_py.workers.data_loader import DataCtx

__all__ = ["DataCtx", "EmbeddingCtx", "InferCtx", "TrainCtx", "current_ctx", "eval_ctx"]
