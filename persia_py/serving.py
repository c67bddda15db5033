"""Online predictions from a checkpoint: ``persia-launcher serve``.

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

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import torch

from persia_py import checkpoint_format as fmt
from persia_py import codec
from persia_py.config import CommonConfig, load_global_config
from persia_py.ctx import InferCtx
from persia_py.dense_checkpoint import read_full_model
from persia_py.dense_export import DenseFollower, DenseModelSlot
from persia_py.embedding.data import IDTypeFeature, NonIDTypeFeature, PersiaBatch
from persia_py.proto import serving_pb2 as pb
from persia_py.proto import serving_pb2_grpc
from persia_py.rpc import ServiceClient, create_channel, create_server, grpc_method, wait_for_ready

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
    model.load_state_dict(read_full_model(folder))
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
        self.models = models or DenseModelSlot(ctx.model)

    @grpc_method
    def Predict(self, request, context):
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


# -- persia-launcher serve ------------------------------------------------------------------


def _wait_for_roles(cluster, addresses: list[str], common: CommonConfig,
                    stop: threading.Event) -> bool:
    """Wait until every address accepts connections; False if ``stop`` was set first.
    A role that exits meanwhile (e.g. a checkpoint it cannot load) ends the wait."""
    deadline = time.monotonic() + common.startup_timeout_sec
    for address in addresses:
        channel = create_channel(address, common)
        try:
            while True:
                if stop.is_set():
                    return False
                for role in cluster.roles:
                    code = role.process.poll()
                    if code is not None:
                        raise SystemExit(f"serve: {role.name} exited with code {code} while "
                                         "starting (see its output above)")
                if time.monotonic() > deadline:
                    raise SystemExit(f"serve: {address} not reachable within "
                                     f"{common.startup_timeout_sec:.0f}s")
                try:
                    wait_for_ready(channel, address, 1.0)
                    break
                except TimeoutError:
                    continue
        finally:
            channel.close()
    return True


def _follow_dense(args: argparse.Namespace, slot: DenseModelSlot,
                  factory: Callable[[], torch.nn.Module], device: torch.device,
                  global_config) -> tuple[DenseFollower | None, object]:
    """The started follower of ``--follow-dense`` (None without it) and the metrics
    endpoint of ``--metrics-port`` (None without it): the dense model's age and loads."""
    from prometheus_client import CollectorRegistry, Counter

    from persia_py.monitoring import register_freshness, serve_metrics

    registry = CollectorRegistry()
    failures = Counter("persia_serving_dense_load_failures",
                       "Failed attempts to load a dense model version (each is retried)",
                       registry=registry)
    follower = None
    if args.follow_dense:
        every_sec = global_config.checkpoint_config.dense_export_every_sec
        follower = DenseFollower(slot, args.follow_dense,
                                 lambda: build_model(factory).to(device),
                                 warn_after_sec=2 * every_sec or None,
                                 on_failure=failures.inc).start()
    register_freshness(registry, "dense_model", lambda: max(0.0, time.time() - slot.created_unix),
                       lambda: 0 if follower is None else follower.num_loaded)
    metrics_server = (None if args.metrics_port is None
                      else serve_metrics(registry, args.metrics_port, args.bind, "serve"))
    return follower, metrics_server


def run_serve(args: argparse.Namespace) -> int:
    from persia_py.env import ENV_EMBEDDING_CONFIG, ENV_GLOBAL_CONFIG, ENV_PS_ADDRS
    from persia_py.launcher.local import LocalCluster, Role, free_ports
    from persia_py.launcher.roles import validate_configs

    if args.num_ps < 1:
        raise SystemExit("--num-ps must be >= 1")
    validate_configs(args.global_config, args.embedding_config)
    global_config = load_global_config(args.global_config)
    try:
        folder = fmt.resolve(args.checkpoint)
    except fmt.CheckpointError as exc:
        raise SystemExit(f"--checkpoint: {exc}") from None
    factory = load_factory(args.model)
    model = load_dense_model(factory, folder)
    print(f"serve: dense model {args.model} loaded from {folder}", flush=True)

    host = args.bind
    *ps_ports, ew_port = free_ports(args.num_ps + 1, host)
    ps_addrs = [f"{host}:{p}" for p in ps_ports]
    env = dict(os.environ)
    env.update({ENV_EMBEDDING_CONFIG: os.path.abspath(args.embedding_config),
                ENV_PS_ADDRS: ",".join(ps_addrs), "PYTHONUNBUFFERED": "1"})
    if args.global_config:
        env[ENV_GLOBAL_CONFIG] = os.path.abspath(args.global_config)
    launcher = [sys.executable, "-m", "persia_py.launcher.cli"]
    follow = (["--follow-increments", os.path.abspath(args.follow_increments)]
              if args.follow_increments else [])
    insecure = ["--insecure"] if args.insecure else []  # the servers have no token either
    if args.metrics_port is not None:  # each replica prints its endpoint (freshness, load)
        insecure.extend(["--metrics-port", "0"])
    roles = [Role(f"ps-{i}", [*launcher, "embedding-parameter-server", "--port", str(p),
                              "--bind", host, "--replica-index", str(i),
                              "--replica-size", str(args.num_ps), "--inference", *insecure,
                              "--load-checkpoint", str(folder), *follow])
             for i, p in enumerate(ps_ports)]
    for role in roles:  # a replica that dies comes back from the same checkpoint
        role.restart = (lambda command: lambda: command)(role.command)
    roles.append(Role("embedding-worker-0", [*launcher, "embedding-worker", "--port",
                                             str(ew_port), "--bind", host, *insecure]))
    cluster = LocalCluster(roles, env)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        ew_addr = f"{host}:{ew_port}"
        if not _wait_for_roles(cluster, [*ps_addrs, ew_addr], global_config.common_config,
                               stop):
            return 0
        with InferCtx(model=model, embedding_worker_addresses=[ew_addr],
                      global_config=global_config, device_id=args.device_id) as ctx:
            model.to(ctx.device)
            slot = DenseModelSlot(model, created_unix=(folder / fmt.MANIFEST).stat().st_mtime)
            follower, metrics_server = _follow_dense(args, slot, factory, ctx.device,
                                                     global_config)
            server, port = create_serving_server(ctx, f"{host}:{args.port}", slot)
            print(f"serve: parameter servers {','.join(ps_addrs)}", flush=True)
            print(f"serve ready on port {port}", flush=True)
            try:
                return cluster.supervise(stop)
            finally:
                server.stop(grace=2.0).wait(10.0)
                if metrics_server is not None:
                    metrics_server.close()
                if follower is not None:
                    follower.close()
    finally:
        cluster.stop()
