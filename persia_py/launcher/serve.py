"""``persia-launcher serve``: a supervised serving replica of a checkpoint (parameter
servers and an embedding worker loading it, the serving gRPC front answering
:class:`~persia_py.serving.ServingClient`), following new exports when asked."""

from __future__ import annotations

import logging
import os
import select
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.dense_export import DenseFollower, DenseModelSlot
from persia_py.config import CommonConfig, load_global_config
from persia_py.ctx import InferCtx
from persia_py.launcher import role_commands, stop_signals
from persia_py.launcher.job_model import NO_SCRIPT, Job, Placement
from persia_py.launcher.role_kinds import EMBEDDING_WORKER, PARAMETER_SERVER
from persia_py.launcher.role_options import ServeOptions
from persia_py.ops import safe_files
from persia_py.serving import (
    build_model,
    create_serving_server,
    load_dense_model,
    load_factory,
)
from persia_py.wire.rpc import create_channel, wait_for_ready

if TYPE_CHECKING:
    from persia_py.launcher.local import Role
    from persia_py.telemetry.monitoring import MetricsServer

logger = logging.getLogger(__name__)

CHECKPOINT_POLL_SEC = 0.5
"""How often ``--wait`` looks for the first checkpoint (as often as the followers look
for new increments)."""


def _wait_for_roles(cluster, addresses: list[str], common: CommonConfig,
                    stop: stop_signals.Requested) -> bool:
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
                    code = role.started.poll()
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


def _checkpoint_to_serve(path: str, *, wait: bool, stop: stop_signals.Requested
                         ) -> Path | None:
    """The complete checkpoint ``path`` names. Before training's first one, SystemExit
    saying so, or with ``wait`` the first one once complete (None: ``stop`` came first)."""
    announced = False
    while True:
        try:
            return fmt.resolve(path)
        except fmt.NoCheckpointYet as exc:
            if not wait:
                raise SystemExit(
                    f"--checkpoint: {exc}: the training job has not written its first "
                    f"checkpoint there yet (or the path is not its checkpoint_config.dir); "
                    f"start serve once it has, or pass --wait to serve that checkpoint as "
                    f"soon as it is complete") from None
            if not announced:
                print(f"serve: waiting for the training job's first checkpoint in {path} "
                      f"({exc})", flush=True)
                announced = True
        except safe_files.CheckpointError as exc:
            raise SystemExit(f"--checkpoint: {exc}") from None
        # Wakes at once on SIGTERM or SIGINT (their wakeup descriptor turns readable).
        select.select([stop_signals.wakeup_fd()], [], [], CHECKPOINT_POLL_SEC)
        if stop.is_set():
            return None


def _follow_dense(options: ServeOptions, slot: DenseModelSlot,
                  factory: Callable[[], torch.nn.Module], device: torch.device,
                  global_config) -> tuple[DenseFollower | None, MetricsServer | None]:
    """The started follower of ``--follow-dense`` (None without it) and the metrics
    endpoint of ``--metrics-port`` (None without it): the dense model's age and loads."""
    from prometheus_client import CollectorRegistry, Counter

    from persia_py.telemetry.monitoring import register_freshness, serve_metrics

    registry = CollectorRegistry()
    failures = Counter("persia_serving_dense_load_failures",
                       "Failed attempts to load a dense model version (each is retried)",
                       registry=registry)
    follower = None
    if options.follow_dense:
        every_sec = global_config.checkpoint_config.dense_export_every_sec
        follower = DenseFollower(slot, options.follow_dense,
                                 lambda: build_model(factory).to(device),
                                 warn_after_sec=2 * every_sec or None,
                                 on_failure=failures.inc).start()
    register_freshness(registry, "dense_model", lambda: max(0.0, time.time() - slot.created_unix),
                       lambda: 0 if follower is None else follower.num_loaded)
    metrics_server = (None if options.metrics_port is None
                      else serve_metrics(registry, options.metrics_port, options.bind, "serve"))
    return follower, metrics_server


def _server_roles(options: ServeOptions, embedding_config: str, folder: Path, host: str,
                  ps_ports: list[int], ew_port: int) -> list[Role]:
    """The parameter servers, serving replicas of ``folder`` (a replica that dies comes
    back from the same checkpoint), and the embedding worker; their commands built as
    every engine's (:mod:`persia_py.launcher.role_commands`)."""
    from persia_py.launcher import local

    job = Job(embedding_config=embedding_config,
              global_config=options.global_config, nn_worker=NO_SCRIPT,
              data_loader=NO_SCRIPT, num_ps=options.num_ps, insecure=options.insecure)
    launcher = (sys.executable, "-m", "persia_py.launcher.cli")
    # With --metrics-port each replica prints its endpoint (freshness, load).
    metrics_port = None if options.metrics_port is None else 0
    follow = options.follow_increments and os.path.abspath(options.follow_increments)
    roles = []
    for i, port in enumerate(ps_ports):
        command = role_commands.parameter_server(job, Placement(
            launcher, str(i), port, host, metrics_port=metrics_port, inference=True,
            load_checkpoint=str(folder), follow_increments=follow or None))
        role = local.Role(f"{PARAMETER_SERVER.short}-{i}", command)
        role.restart = (lambda fixed: lambda: fixed)(command)
        roles.append(role)
    roles.append(local.Role(f"{EMBEDDING_WORKER.short}-0", role_commands.embedding_worker(
        job, Placement(launcher, "0", ew_port, host, metrics_port=metrics_port)),
        kind=EMBEDDING_WORKER))
    return roles


def run_serve(options: ServeOptions) -> int:
    from persia_py.env import ENV_EMBEDDING_CONFIG, ENV_GLOBAL_CONFIG, ENV_PS_ADDRS
    from persia_py.launcher.local import LocalCluster
    from persia_py.launcher.ports import free_ports
    from persia_py.launcher.roles import validate_configs

    if options.num_ps < 1:
        raise SystemExit("--num-ps must be >= 1")
    assert options.embedding_config is not None, "serve's parser requires it"
    embedding_config = os.path.abspath(options.embedding_config)
    validate_configs(options.global_config, options.embedding_config)
    global_config = load_global_config(options.global_config)
    stop_signals.on_stop_signals()  # read from a descriptor (persia_py/launcher/stop_signals.py)
    stop = stop_signals.Requested()
    folder = _checkpoint_to_serve(options.checkpoint, wait=options.wait, stop=stop)
    if folder is None:
        print("serve: stopped while waiting for the first checkpoint", flush=True)
        return 0
    factory = load_factory(options.model)
    model = load_dense_model(factory, folder)
    print(f"serve: dense model {options.model} loaded from {folder}", flush=True)

    host = options.bind
    *ps_ports, ew_port = free_ports(options.num_ps + 1, host)
    ps_addrs = [f"{host}:{p}" for p in ps_ports]
    env = dict(os.environ)
    env.update({ENV_EMBEDDING_CONFIG: embedding_config,
                ENV_PS_ADDRS: ",".join(ps_addrs), "PYTHONUNBUFFERED": "1"})
    if options.global_config:
        env[ENV_GLOBAL_CONFIG] = os.path.abspath(options.global_config)
    roles = _server_roles(options, embedding_config, folder, host, ps_ports, ew_port)
    cluster = LocalCluster(roles, env)
    try:
        cluster.start()
        ew_addr = f"{host}:{ew_port}"
        if not _wait_for_roles(cluster, [*ps_addrs, ew_addr], global_config.common_config,
                               stop):
            return 0
        with InferCtx(model=model, embedding_worker_addresses=[ew_addr],
                      global_config=global_config, device_id=options.device_id) as ctx:
            model.to(ctx.device)
            slot = DenseModelSlot(model, created_unix=(folder / fmt.MANIFEST).stat().st_mtime)
            follower, metrics_server = _follow_dense(options, slot, factory, ctx.device,
                                                     global_config)
            server, port = create_serving_server(ctx, f"{host}:{options.port}", slot)
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
