"""Online predictions from a checkpoint: the model and gRPC service behind
``persia-launcher serve`` (supervised by :mod:`persia_py.launcher.serve`), and its client.

The serving process owns the dense model (built by the user's factory, weights loaded
from the checkpoint's ``dense-model`` arrays; nothing is unpickled) and a supervised set
of role processes: parameter-server replicas in inference mode that load the
checkpoint's rows (lookups never insert, updates are refused) and an embedding worker.
The ``Serving.Predict`` RPC takes a batch's ID features (CSR) and dense features, looks
the embeddings up through :class:`~persia_py.ctx.InferCtx` and answers the model's
output: the same code path as ``eval_ctx`` on the training side, so served predictions
equal the training job's evaluation of the same rows.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import torch

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.dense_export import DenseModelSlot
from persia_py.config import CommonConfig
from persia_py.ctx import InferCtx
from persia_py.embedding.data import IDTypeFeature, NonIDTypeFeature, PersiaBatch
from persia_py.proto import serving_pb2 as pb
from persia_py.proto import serving_pb2_grpc
from persia_py.wire import codec
from persia_py.wire.rpc import ServiceClient, create_server, grpc_method

__all__ = ["ServingClient", "build_model", "load_dense_model", "load_factory"]

logger = logging.getLogger(__name__)


# -- the dense model -------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """The callable ``MODULE:FACTORY`` names; MODULE is an importable module name or a
    ``.py`` file (whose folder is put on ``sys.path`` so that its own imports work)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model expects MODULE:FACTORY (e.g. my_pkg.model:build or "
                         f"path/to/model.py:DLRM), got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ValueError(f"--model: {path} is not a file")
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"--model: {path} cannot be imported as a module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name} has no callable {attr!r}")
    return factory


def build_model(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``factory()``, checked to be a torch module."""
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model factory returned a {type(model).__name__}, not a "
                        "torch.nn.Module")
    return model


def load_dense_model(factory: Callable[[], torch.nn.Module],
                     checkpoint: str | os.PathLike) -> torch.nn.Module:
    """``factory()`` with the dense weights of ``checkpoint`` (a root or a folder), in eval mode."""
    folder = fmt.resolve(checkpoint)
    model = build_model(factory)
    # Whole or sharded (FSDP: every rank's shards, gathered here in one process).
    if fmt.is_sharded(folder):
        from persia_py.checkpoint.dense import read_full_model  # torch.distributed.checkpoint

        model.load_state_dict(read_full_model(folder))
    else:
        model.load_state_dict(fmt.load_tensors(folder, "dense-model"))
    return model.eval()


# -- the service ------------------------------------------------------------------------------


def batch_from_request(request: pb.PredictRequest) -> PersiaBatch:
    """The PersiaBatch (no labels, no gradients) a PredictRequest describes."""
    if not request.id_features:
        raise ValueError("id_features: a batch needs its ID features")
    id_features = [IDTypeFeature.from_csr(*codec.decode_id_feature(f, f"id_features[{i}]"))
                   for i, f in enumerate(request.id_features)]
    dense = [NonIDTypeFeature(codec.decode(t, name=f"non_id_features[{i}]"))
             for i, t in enumerate(request.non_id_features)]
    return PersiaBatch(id_features, non_id_type_features=dense, requires_grad=False)


class ServingServicer(serving_pb2_grpc.ServingServicer):
    """Predict: decode, look up through ``ctx`` (never inserting), run the model, encode.
    ``models``: where the dense model is read, once per request (a follower swaps new
    versions in); default: the context's model."""

    def __init__(self, ctx: InferCtx, models: DenseModelSlot | None = None) -> None:
        self.ctx = ctx
        if models is None:
            if ctx.model is None:
                raise ValueError("ServingServicer: the context has no model; pass models")
            models = DenseModelSlot(ctx.model)
        self.models = models

    @grpc_method
    def Predict(self, request: pb.PredictRequest, context: grpc.ServicerContext) -> pb.PredictResponse:
        batch = batch_from_request(request)
        model, _ = self.models.current()  # this request's model, whatever is swapped in later
        output, _ = self.ctx.forward(self.ctx.prepare(batch), model=model)
        outputs = output if isinstance(output, (tuple, list)) else [output]
        return pb.PredictResponse(outputs=[
            codec.encode(o.detach().float().cpu().numpy()) for o in outputs])


def create_serving_server(ctx: InferCtx, address: str, models: DenseModelSlot | None = None
                          ) -> tuple[grpc.Server, int]:
    """A started Serving gRPC server on ``address``; returns (server, port)."""
    server, port = create_server(address, ctx.common)
    serving_pb2_grpc.add_ServingServicer_to_server(ServingServicer(ctx, models), server)
    server.start()
    return server, port


class ServingClient(ServiceClient):
    """Client of ``persia-launcher serve``."""

    service_name = "serving"
    stub_class = serving_pb2_grpc.ServingStub

    def __init__(self, address: str, common: CommonConfig | None = None) -> None:
        super().__init__(address, common or CommonConfig())

    def predict(self, id_features: list[tuple[str, np.ndarray, np.ndarray]],
                non_id_features: list[np.ndarray]) -> list[np.ndarray]:
        """The model's outputs for one batch: ``(slot, ids, lengths)`` per slot, dense arrays."""
        request = pb.PredictRequest(
            id_features=[codec.encode_id_feature(*f) for f in id_features],
            non_id_features=[codec.encode(a) for a in non_id_features],
        )
        answer = self._call(self.stub.Predict, request, idempotent=True)
        return [codec.decode(t, name=f"outputs[{i}]") for i, t in enumerate(answer.outputs)]
