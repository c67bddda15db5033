"""What :class:`persia_py.ctx.train_ctx.TrainCtx` checks as it is made, before any process
group, server or file is touched: its arguments' types, the checkpoint settings and what
FSDP over several ranks cannot do. A mistake is a clear error at the call, not a failure
at the first checkpoint or after the ranks have joined."""

from __future__ import annotations

import torch

from persia_py.checkpoint.dense_export import check_dense_export
from persia_py.config import CheckpointConfig, ConfigError
from persia_py.config.checks import check_type
from persia_py.dense.grad_control import GradControl
from persia_py.distributed import DDPOption, FSDPOption
from persia_py.embedding import EmbeddingConfig
from persia_py.embedding.optim import Optimizer
from persia_py.ops.start_checks import check_checkpoint_paths
from persia_py.progressive import ProgressiveValidation


def check_arguments(model: object, embedding_optimizer: object, dense_optimizer: object,
                    embedding_config: object, mixed_precision: object, stop_on_signal: object,
                    progressive_validation: object, distributed_option: object) -> None:
    """Every argument's type, before any file or environment is read."""
    check_type("TrainCtx(model=...)", model, torch.nn.Module,
               "a torch.nn.Module (the dense tower)")
    check_type("TrainCtx(embedding_optimizer=...)", embedding_optimizer, Optimizer,
               "an optimizer from persia_py.embedding.optim (SGD, Adagrad or Adam)")
    check_type("TrainCtx(dense_optimizer=...)", dense_optimizer, torch.optim.Optimizer,
               "a torch.optim optimizer over model.parameters()")
    check_type("TrainCtx(embedding_config=...)", embedding_config, EmbeddingConfig,
               "a persia_py.embedding.EmbeddingConfig or None", optional=True)
    check_type("TrainCtx(mixed_precision=...)", mixed_precision, bool, "a bool")
    check_type("TrainCtx(stop_on_signal=...)", stop_on_signal, bool, "a bool")
    check_type("TrainCtx(progressive_validation=...)", progressive_validation,
               ProgressiveValidation, "a persia_py.progressive.ProgressiveValidation or None",
               optional=True)
    check_type("TrainCtx(distributed_option=...)", distributed_option,
               (DDPOption, FSDPOption), "a persia_py.distributed.DDPOption or FSDPOption",
               optional=True)


def check_checkpoint_config(checkpoints: CheckpointConfig, grad_control: GradControl,
                            stop_on_signal: bool) -> None:
    """Config errors now, not at the first checkpoint or the end (start_checks)."""
    check_checkpoint_paths(checkpoints)
    if stop_on_signal and not checkpoints.dir:
        raise ConfigError("checkpoint_config.dir: required with TrainCtx(stop_on_signal="
                          "True): the training ends with a checkpoint there, which the job "
                          "started again goes on from")
    grad_control.check_checkpoint_period(checkpoints.every_steps)


def check_sharded_options(option: DDPOption | FSDPOption, world_size: int,
                          grad_control: GradControl, checkpoints: CheckpointConfig) -> None:
    """What FSDP over several ranks cannot do, refused now, not after joining the
    process group (``TrainCtx.__enter__`` shards the model then)."""
    sharded = isinstance(option, FSDPOption) and world_size > 1
    if sharded and grad_control.grad_accumulation_steps > 1:
        raise ValueError(
            "TrainCtx(grad_accumulation_steps=...) > 1 is not supported with "
            "FSDPOption on several ranks; use DDPOption or a larger batch")
    check_dense_export(checkpoints, sharded=sharded)
