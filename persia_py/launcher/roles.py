"""Entry points of the server roles and of the user-script roles."""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from persia_py.config import (
    ConfigError,
    EmbeddingTablesConfig,
    GlobalConfig,
    load_embedding_config,
    load_global_config,
)
from persia_py.env import (
    ENV_BIND_HOST,
    ENV_DATA_LOADER_HANDOVER_LOG,
    ENV_DATA_LOADER_PORT,
    ENV_DATA_LOADER_REPLAY,
    ENV_DATA_LOADER_REPLICA_INDEX,
    ENV_DATA_LOADER_REPLICA_SIZE,
    ENV_EMBEDDING_CONFIG,
    ENV_GLOBAL_CONFIG,
    ENV_PS_ADDRS,
    PersiaEnv,
)
from persia_py.launcher import job_token, stop_signals
from persia_py.launcher.local_ranks import run_ranks
from persia_py.launcher.loopback import loopback_env, torchrun_command
from persia_py.launcher.processes import die_with_parent, run_torchrun
from persia_py.launcher.role_options import (
    DataLoaderOptions,
    EmbeddingWorkerOptions,
    NNWorkerOptions,
    ParameterServerOptions,
    RoleOptions,
    ServerOptions,
)
from persia_py.ops import allocator
from persia_py.ops.final_errors import DATA_EXIT_CODE, ENV_FINAL_CONFIG_ERRORS
from persia_py.ops.start_checks import (
    CONFIG_EXIT_CODE,
    Written,
    check_checkpoint_paths,
    check_writable,
    written_by_servers,
    written_by_training,
)
from persia_py.telemetry.events import ENV_TRAIN_LOG
from persia_py.telemetry.monitoring import ENV_METRICS_PORT, serve_metrics

if TYPE_CHECKING:
    from persia_py.servers.parameter_server import ParameterServer

logger = logging.getLogger("persia_py.launcher")


def _config_paths(options: RoleOptions) -> tuple[str | None, str | None]:
    return (options.global_config or os.environ.get(ENV_GLOBAL_CONFIG) or None,
            options.embedding_config or os.environ.get(ENV_EMBEDDING_CONFIG) or None)


def require_token(options: RoleOptions) -> None:
    """Stop a role that has no job token, unless it was started with ``--insecure``."""
    global_path, _ = _config_paths(options)
    job_token.require_token(f"persia-launcher {options.command}", global_path,
                            options.insecure)


def _server_configs(options: RoleOptions) -> tuple[GlobalConfig, EmbeddingTablesConfig]:
    """Tune this server's malloc, then read both of its config files (both required)."""
    allocator.tune_this_process()
    global_path, embedding_path = _config_paths(options)
    if embedding_path is None:
        raise ConfigError(f"--embedding-config (or {ENV_EMBEDDING_CONFIG}) is required")
    return load_global_config(global_path), load_embedding_config(embedding_path)


def validate_configs(global_path: str | None, embedding_path: str | None) -> None:
    """Read both config files strictly; ConfigError names the file and the key."""
    load_global_config(global_path)
    if embedding_path is not None:
        load_embedding_config(embedding_path)


HOLD_ON_CONFIG_ERROR = "--hold-on-config-error"
"""The flag of the roles a supervisor restarts whatever their exit code (Kubernetes
StatefulSets: ``persia-launcher k8s`` renders it for them): a role that stopped on a
config error holds instead of exiting (:func:`hold_after_config_error`)."""


def add_hold_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(HOLD_ON_CONFIG_ERROR, action="store_true",
                   help=f"when the role stops on a config error (exit code {CONFIG_EXIT_CODE}; "
                        "a data loader's script's too) or a data loader's script on a data "
                        f"error (exit code {DATA_EXIT_CODE}), say so and wait for SIGTERM or "
                        "SIGINT, then exit with that code: for a supervisor that restarts the role "
                        "whatever its exit code (a Kubernetes StatefulSet), which would start "
                        "it into the same error again and again")


def hold_after_config_error(command: str, code: int = CONFIG_EXIT_CODE) -> int:
    """``--hold-on-config-error``: the role ``command`` stopped on a config error, or a
    data loader's script on a data error (``code``: :data:`CONFIG_EXIT_CODE` or
    :data:`DATA_EXIT_CODE`; its message printed); wait for SIGTERM or SIGINT, then return
    ``code``. A StatefulSet restarts its pods whatever their exit code, and a restart would
    meet the same error: the pod holds until the job is deleted, or fixed and applied
    again."""
    stop_signals.on_stop_signals()
    what, fix = (("a data error", "fix or remove the input") if code == DATA_EXIT_CODE
                 else ("a config error", "fix the config"))
    print(f"persia-launcher {command}: stopped on {what} (code {code}; its message is above); "
          "holding instead of exiting, so that its supervisor does not restart it into the "
          f"same error: {fix} and apply the job again, or delete it (exits {code} on "
          "SIGTERM)", file=sys.stderr, flush=True)
    stop_signals.wait_for_stop_signal()
    return code


def _serve_until_signal(server, what: str) -> int:
    stop_signals.on_stop_signals()
    print(f"{what} ready", flush=True)
    stop_signals.wait_for_stop_signal()
    server.stop(grace=2.0).wait(10.0)
    return 0


def _serve(options: ServerOptions, server, port: int, registry, what: str) -> int:
    """Serve until SIGTERM/SIGINT, with the metrics endpoint when ``--metrics-port`` asks."""
    assert options.bind is not None, "a server's --bind has a default"
    metrics_server = (None if options.metrics_port is None else
                      serve_metrics(registry, options.metrics_port, options.bind, what))
    try:
        return _serve_until_signal(server, f"{what} on port {port}")
    finally:
        if metrics_server is not None:
            metrics_server.close()


def _check_parameter_server(options: ParameterServerOptions, global_config: GlobalConfig,
                            inference: bool) -> None:
    """Refuse, before the tables are made, what a restart would meet again (final):
    checkpoint folders outside the root, flags that cannot go together, folders it cannot
    write (it would stop at its first write, every restart)."""
    if not inference:  # it serves Dump into checkpoint_config.dir, exports increments
        check_checkpoint_paths(global_config.checkpoint_config, root=options.checkpoint_root)
    if options.replay_update_log and not options.update_log:
        raise ConfigError("--replay-update-log needs --update-log DIR")
    if options.follow_increments and not inference:
        raise ConfigError("--follow-increments needs --inference (a serving replica)")
    if not inference:
        check_writable([
            *written_by_servers(global_config.checkpoint_config, root=options.checkpoint_root),
            *([Written(options.update_log, "--update-log")] if options.update_log else [])])


def _load_rows(ps: ParameterServer, options: ParameterServerOptions,
               global_config: GlobalConfig) -> None:
    """Fill ``ps`` from its update log (and the checkpoint it starts from), else from
    ``--load-checkpoint``; neither: it starts empty."""
    if options.update_log:
        from persia_py.servers.replica_start import open_update_log

        try:
            what = open_update_log(
                ps, options.update_log, replay=options.replay_update_log,
                checkpoint=options.load_checkpoint,
                root=options.checkpoint_root or global_config.checkpoint_config.root,
                max_bytes=options.update_log_max_bytes)
        except ValueError as exc:  # a serving replica, or a log no restart can start from
            raise SystemExit(f"--update-log {options.update_log}: {exc}") from None
        print(f"embedding-parameter-server {options.replica_index}: {what}", flush=True)
    elif options.load_checkpoint:
        from persia_py.servers.checkpoint import load_replica

        num_rows, _ = load_replica(ps, options.load_checkpoint)
        print(f"embedding-parameter-server {options.replica_index} loaded {num_rows} rows "
              f"from checkpoint {options.load_checkpoint}", flush=True)


def _start_increments(ps: ParameterServer, options: ParameterServerOptions,
                      global_config: GlobalConfig, metrics, inference: bool,
                      checkpoint_root: str | None) -> list:
    """The started thread that follows (a serving replica) or exports (training) the
    incremental exports, if any: the caller closes it."""
    from persia_py.servers.increments import (
        IncrementalExporter,
        IncrementFollower,
        base_increment_seqs,
    )

    ckpt_cfg = global_config.checkpoint_config
    if options.follow_increments:
        from persia_py.telemetry.monitoring import register_freshness

        after = base_increment_seqs(options.load_checkpoint) if options.load_checkpoint else {}
        # Behind once the newest applied increment is older than 2 export intervals.
        every_sec = ckpt_cfg.incremental_every_sec
        follower = IncrementFollower(
            ps, options.follow_increments, after=after, warn_after_sec=2 * every_sec or None,
            on_failure=metrics.increment_failures.labels("apply").inc)
        register_freshness(metrics.registry, "increment", follower.age_sec,
                           lambda: follower.num_applied)
        return [follower.start()]
    if not inference and (ckpt_cfg.incremental_every_updates or ckpt_cfg.incremental_every_sec):
        assert ckpt_cfg.incremental_dir is not None, "CheckpointConfig requires it with either"
        return [IncrementalExporter(
            ps, ckpt_cfg.incremental_dir, every_updates=ckpt_cfg.incremental_every_updates,
            every_sec=ckpt_cfg.incremental_every_sec, root=checkpoint_root,
            on_failure=metrics.increment_failures.labels("export").inc).start()]
    return []


def run_parameter_server(options: ParameterServerOptions) -> int:
    from persia_py.servers.increments import IncrementalExporter
    from persia_py.servers.metrics import ParameterServerMetrics
    from persia_py.servers.parameter_server import ParameterServer
    from persia_py.servers.service import create_ps_server

    global_config, embedding_config = _server_configs(options)
    inference = options.inference or global_config.common_config.job_type == "Infer"
    _check_parameter_server(options, global_config, inference)
    ps = ParameterServer(global_config, embedding_config,
                         replica_index=options.replica_index, replica_size=options.replica_size,
                         inference=inference)
    _load_rows(ps, options, global_config)
    checkpoint_root = options.checkpoint_root or global_config.checkpoint_config.root
    metrics = ParameterServerMetrics(ps)
    # The exporter or follower thread, joined on close.
    background = _start_increments(ps, options, global_config, metrics, inference,
                                   checkpoint_root)
    server, port = create_ps_server(ps, f"{options.bind}:{options.port}", metrics,
                                    checkpoint_root=checkpoint_root)
    try:
        return _serve(options, server, port, metrics.registry,
                      f"embedding-parameter-server {options.replica_index}")
    finally:
        try:
            for thread in background:
                thread.close()
                if isinstance(thread, IncrementalExporter):
                    # Stopping (an online job's SIGTERM too): the rows changed since the
                    # last export reach serving as well.
                    thread.export_now()
        finally:
            ps.close()


def run_embedding_worker(options: EmbeddingWorkerOptions) -> int:
    from persia_py.wire.address_book import book_at, servers_now
    from persia_py.workers.embedding_worker import EmbeddingWorker
    from persia_py.workers.embedding_worker_service import create_embedding_worker_server
    from persia_py.workers.ps_client import PSClient

    global_config, embedding_config = _server_configs(options)
    env = PersiaEnv.from_environ()
    ps_addrs = options.ps_addrs.split(",") if options.ps_addrs else env.ps_addrs
    if not ps_addrs:
        raise ConfigError(f"--ps-addrs (or {ENV_PS_ADDRS}) is required")
    # With the job's address book, each replica where the book has it now (a restart after
    # one moved) and again wherever it moves (persia_py/wire/address_book.py).
    clients = [PSClient(a, global_config.common_config, book=e)
               for a, e in servers_now(ps_addrs, book_at(env.address_book))]
    for c in clients:
        c.wait_ready()
    from persia_py.workers.metrics import EmbeddingWorkerMetrics

    worker = EmbeddingWorker(global_config, embedding_config, clients,
                             index=options.replica_index)
    metrics = EmbeddingWorkerMetrics(worker)
    worker.on_lookup_timed = metrics.observe_lookup
    server, port = create_embedding_worker_server(worker, f"{options.bind}:{options.port}")
    try:
        return _serve(options, server, port, metrics.registry,
                      f"embedding-worker {options.replica_index}")
    finally:
        worker.close()


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Run a child in the foreground; pass SIGTERM/SIGINT on to it. It dies with this
    process (persia_py/launcher/lifeline.py); this process ends as it did (its exit code,
    or the signal that killed it)."""
    stop_signals.on_stop_signals()
    child = subprocess.Popen(command, env=env, preexec_fn=die_with_parent())
    exited = os.pidfd_open(child.pid)  # readable once the child has exited
    try:
        unread = stop_signals.Unread()
        while child.poll() is None:
            select.select([exited, stop_signals.wakeup_fd()], [], [],
                          stop_signals.STOP_POLL_SEC)
            for sig in unread.new():
                child.send_signal(sig)
    finally:
        os.close(exited)
    if child.returncode < 0:
        # Killed by a signal: end by the same one, so that the supervisor says what
        # killed the script (an exit code of -9 would read as 247).
        if -child.returncode != signal.SIGKILL:  # whose disposition cannot change
            signal.signal(-child.returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -child.returncode)
        return 128 - child.returncode  # a signal that does not end a process
    return child.returncode


def _user_env(options: RoleOptions) -> dict[str, str]:
    """This process's environment plus the config paths, for a user script; both config
    files are validated first, checkpoint folders included, so a bad key stops the role
    before the script starts; one the script meets itself before any progress ends it
    with ``CONFIG_EXIT_CODE`` too (:mod:`persia_py.ops.final_errors`). The
    script starts with persia_py's malloc settings (:mod:`persia_py.ops.allocator`)."""
    env = allocator.with_tunables(dict(os.environ))
    env[ENV_FINAL_CONFIG_ERRORS] = "1"
    global_path, embedding_path = _config_paths(options)
    validate_configs(global_path, embedding_path)
    # The ranks write checkpoints into checkpoint_config.dir: refused now, not at the first.
    check_checkpoint_paths(load_global_config(global_path).checkpoint_config)
    if global_path:
        env[ENV_GLOBAL_CONFIG] = global_path
    if embedding_path:
        env[ENV_EMBEDDING_CONFIG] = embedding_path
    if options.metrics_port is not None:
        env[ENV_METRICS_PORT] = str(options.metrics_port)
    return env


def run_nn_worker(options: NNWorkerOptions) -> int:
    """The user's training script under torchrun (torch.distributed elastic), or, on one
    node that restarts no rank, as torchrun would run it."""
    env = _user_env(options)
    log_flag = f"${ENV_TRAIN_LOG}" if ENV_TRAIN_LOG in env else "--train-log"
    env.setdefault(ENV_TRAIN_LOG, os.path.abspath(options.train_log))
    # Its folder may be new (a job's folder on a shared volume, made by whichever role
    # starts first); rank 0 appends to the file.
    os.makedirs(os.path.dirname(env[ENV_TRAIN_LOG]), exist_ok=True)
    global_config = load_global_config(env.get(ENV_GLOBAL_CONFIG))
    deadline = int(min(60, max(5, global_config.common_config.rpc_timeout_sec)))
    one_node = options.nnodes == 1 and not options.rdzv_endpoint
    if options.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1; got {options.nproc_per_node}")
    # Refused here, not by a rank at its first write (torchrun would restart the ranks
    # into the same error).
    check_writable([*written_by_training(global_config.checkpoint_config),
                    Written(env[ENV_TRAIN_LOG], log_flag, file=True)])
    if one_node and options.max_restarts == 0 and options.nproc_per_node == 1:
        # torchrun's agent would only host the store and watch the rank: done here,
        # without its cost (persia_py/launcher/local_ranks.py). Several ranks stay under
        # torchrun: there the saving is nil (this process would import torch for the
        # store too), and a two-rank online job ending by itself sometimes exited 1
        # here (tests/test_online_ends.py; not understood yet).
        return run_ranks([options.script, *options.script_args], options.nproc_per_node,
                         loopback_env(env), port=options.master_port or 0)
    if one_node:
        # Every port the ranks open on loopback (persia_py/launcher/loopback.py).
        env = loopback_env(env)
        command = torchrun_command(options.master_port or 0)
    else:
        command = [sys.executable, "-m", "torch.distributed.run"]
    command += [f"--nproc-per-node={options.nproc_per_node}", f"--nnodes={options.nnodes}",
                f"--max-restarts={options.max_restarts}"]
    if options.local_addr:
        # What the other nodes dial (MASTER_ADDR when this node gets rank 0); the hostname
        # may resolve to loopback or to another interface.
        command.append(f"--local-addr={options.local_addr}")
    if options.rdzv_endpoint:
        # Elastic rendezvous (e.g. Kubernetes): torchrun assigns node ranks.
        command += [f"--rdzv-backend={options.rdzv_backend}",
                    f"--rdzv-endpoint={options.rdzv_endpoint}", f"--rdzv-id={options.rdzv_id}"]
        # The agent's calls to the rendezvous store give up within the RPC deadline
        # (at most torch's 60 s) where the store answers late; a dead link is left to
        # run_torchrun.
        conf = [f"read_timeout={deadline}", f"close_timeout={deadline}"]
        if options.local_addr:
            # torchrun guesses the host of the store from the hostname's addresses, which
            # misses a secondary interface; the node's own address says it for sure.
            host = options.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
            conf.insert(0, f"is_host={int(host == options.local_addr)}")
        command.append(f"--rdzv-conf={','.join(conf)}")
    elif not one_node:
        command += [f"--node-rank={options.node_rank}", f"--master-addr={options.master_addr}",
                    f"--master-port={options.master_port or 29500}"]
    return run_torchrun([*command, options.script, *options.script_args], env,
                        grace_sec=deadline)


def run_data_loader(options: DataLoaderOptions) -> int:
    """The user's data-loader script, told its replica index and port."""
    env = _user_env(options)
    env[ENV_DATA_LOADER_REPLICA_INDEX] = str(options.replica_index)
    env[ENV_DATA_LOADER_REPLICA_SIZE] = str(options.replica_size)
    env[ENV_DATA_LOADER_PORT] = str(options.port)
    if options.bind is not None:
        env[ENV_BIND_HOST] = options.bind
    if options.replay_handovers and not options.handover_log:
        raise ConfigError("--replay-handovers needs --handover-log FILE")
    if options.handover_log:
        check_writable([Written(options.handover_log, "--handover-log", file=True)])
        env[ENV_DATA_LOADER_HANDOVER_LOG] = os.path.abspath(options.handover_log)
        env[ENV_DATA_LOADER_REPLAY] = "1" if options.replay_handovers else "0"
    return _run_child([sys.executable, options.script, *options.script_args], env)
