"""The ``persia-launcher`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from persia_py.config import ConfigError
from persia_py.launcher.job_token import add_insecure_flag, add_insecure_token_flag
from persia_py.ops import huge_pages
from persia_py.ops.final_errors import DATA_EXIT_CODE
from persia_py.ops.start_checks import CONFIG_EXIT_CODE
from persia_py.wire.security import ENV_INSECURE_TOKEN

if TYPE_CHECKING:
    from persia_py.launcher.role_options import RoleOptions


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_dir_flag(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An optional folder argument ``flag DIR`` (default None)."""
    p.add_argument(flag, default=None, metavar="DIR", help=help)


def _add_max_restarts(p: argparse.ArgumentParser, default: int, help: str) -> None:
    p.add_argument("--max-restarts", type=_non_negative, default=default, metavar="N",
                   help=help)


def _add_server_flags(p: argparse.ArgumentParser, who: str = "this server",
                      bind_default: str | None = "127.0.0.1") -> None:
    """Port, bind address, replica index and count, metrics, configs, --insecure and
    --hold-on-config-error.
    ``bind_default`` None: the role reads $PERSIA_BIND_HOST (else 127.0.0.1)."""
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: any free port)")
    p.add_argument("--bind", default=bind_default,
                   help=(f"address to bind (default {bind_default}" if bind_default else
                         "address to bind (default: $PERSIA_BIND_HOST, else 127.0.0.1")
                   + "; use 0.0.0.0 or an interface address to serve other hosts)")
    p.add_argument("--replica-index", type=int, default=0, help="index of this replica")
    p.add_argument("--replica-size", type=int, default=1, help="number of replicas of this role")
    _add_metrics_flag(p)
    _add_config_flags(p)
    add_insecure_flag(p, who)
    add_insecure_token_flag(p)
    from persia_py.launcher.roles import add_hold_flag

    add_hold_flag(p)


def _add_metrics_flag(p: argparse.ArgumentParser, extra: str = "") -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://BIND:PORT/metrics (0: any free port, "
                        f"printed at start-up; default: not served){extra}")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-config", default=None,
                   help="global_config.yml (default: $PERSIA_GLOBAL_CONFIG, else all defaults)")
    p.add_argument("--embedding-config", default=None,
                   help="embedding_config.yml (default: $PERSIA_EMBEDDING_CONFIG)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand (one function each below), or of ``command`` alone
    where it names one: a role's process then does not import what the other commands'
    flags need (``plan``'s choices come with the parameter server's sizing, and numba)."""
    parser = argparse.ArgumentParser(
        prog="persia-launcher",
        description="Launch the roles of a persia_py training job.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, subcommand in _SUBCOMMANDS.items():
        if command is None or command not in _SUBCOMMANDS or name == command:
            subcommand.add(sub)
    return parser


def _parameter_server_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embedding-parameter-server", help="serve a shard of the embedding tables")
    _add_server_flags(p)
    _add_dir_flag(p, "--load-checkpoint",
                  "load this replica's rows (and the optimizer settings) from the "
                  "checkpoint DIR (a root: its LATEST; or one checkpoint folder) "
                  "before serving")
    _add_dir_flag(p, "--checkpoint-root",
                  "the only folder whose checkpoints Dump and Load calls may name "
                  "(default: checkpoint_config.root, else the current directory)")
    _add_dir_flag(p, "--update-log",
                  "append every applied update to a log in DIR (a folder this server "
                  "owns), cut at each checkpoint, so that a restart with "
                  "--replay-update-log loses nothing; without --replay-update-log, "
                  "what DIR holds is deleted at start")
    p.add_argument("--update-log-max-bytes", type=int, default=8 << 30, metavar="N",
                   help="most bytes the update log may hold (default 8 GiB); past that (no "
                        "checkpoint cut it for that long) it is deleted and logging stops "
                        "until the next checkpoint")
    p.add_argument("--replay-update-log", action="store_true",
                   help="a restart after a crash: load the checkpoint the --update-log starts "
                        "from and apply its updates again (instead of --load-checkpoint, "
                        "which is used only when the log is empty)")
    p.add_argument("--inference", action="store_true",
                   help="read-only serving replica: lookups never insert rows, updates are "
                        "refused (also when common_config.job_type is Infer)")
    _add_dir_flag(p, "--follow-increments",
                  "with --inference: apply the incremental exports in DIR (after those "
                  "--load-checkpoint already holds) as they appear")


def _embedding_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embedding-worker",
                       help="dedup a batch's ids, look them up on the parameter servers that "
                            "own them, and send back their gradients summed per id")
    _add_server_flags(p)
    p.add_argument("--ps-addrs", default=None,
                   help="comma-separated parameter-server addresses (default: $PERSIA_PS_ADDRS)")


def _nn_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nn-worker", help="run a training script under torchrun")
    p.add_argument("script", help="the training script (each rank runs it)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this machine")
    p.add_argument("--nnodes", type=int, default=1, help="machines (torchrun nodes)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index (static rendezvous)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of node 0 (static rendezvous across machines; with one "
                        "node, the ranks meet on 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="port of node 0 (static rendezvous; default 29500 across "
                        "machines, any free port on 127.0.0.1 with one node)")
    p.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT of an elastic rendezvous (replaces --node-rank and "
                        "--master-addr/--master-port; torchrun assigns node ranks)")
    p.add_argument("--rdzv-backend", default="c10d", help="rendezvous backend (default c10d)")
    p.add_argument("--rdzv-id", default="persia", help="rendezvous id shared by the nodes")
    p.add_argument("--local-addr", default=None, metavar="ADDR",
                   help="this machine's address as the other nodes reach it (default: its "
                        "hostname); with --rdzv-endpoint, the node whose ADDR is the "
                        "endpoint's host hosts the rendezvous")
    _add_max_restarts(p, 0,
                      "torchrun restarts of the ranks after one died (default 0); a "
                      "restarted training rewinds the data loaders and embedding workers "
                      "to its last checkpoint, so they must run under a supervisor "
                      "(persia-launcher local, Kubernetes)")
    p.add_argument("--train-log", default="train_log.jsonl",
                   help="JSON-lines training log rank 0 writes (default: train_log.jsonl; "
                        "$PERSIA_TRAIN_LOG takes precedence)")
    _add_metrics_flag(p, "; rank r serves on PORT + local rank r")
    _add_config_flags(p)
    add_insecure_flag(p, "the training script")
    add_insecure_token_flag(p)


def _data_loader_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data-loader", help="run a data-loader script")
    p.add_argument("script", help="the data-loader script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    _add_server_flags(p, "the data loader", bind_default=None)
    p.add_argument("--handover-log", default=None, metavar="FILE",
                   help="log which batches are handed to which NN-worker request and which "
                        "finished, so that a restart with --replay-handovers goes on where "
                        "this run left off (without it, FILE is emptied at start)")
    p.add_argument("--replay-handovers", action="store_true",
                   help="a restart after a crash: skip the batches the --handover-log says "
                        "were finished, rebuild those still in training (kept for a resend, "
                        "and for a request retried after the crash), send the rest")


def _local_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="run a whole job on this machine")
    from persia_py.launcher.job_flags import add_job_flags, add_supervisor_flags

    add_job_flags(p)
    add_supervisor_flags(p, "the configured token, else a new one per run, handed to the "
                            "roles by environment and written to RUN_DIR/auth_token, mode "
                            "0600, for clients outside the job")
    p.add_argument("--bind", default="127.0.0.1", help="address every server binds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every process (repeatable)")
    p.add_argument("--run-dir", default=None,
                   help="folder of this run's files (training log), made with mode 0700; "
                        "refused when another user owns it or others may write into it; "
                        "default runs/local-<date>-<time>")
    _add_dir_flag(p, "--resume",
                  "continue a job from its last checkpoint in DIR (a checkpoint root or "
                  "folder): the NN workers load it, the data loaders skip the batches "
                  "it had trained")
    p.add_argument("--nn-restarts", choices=("launcher", "torchrun"), default="launcher",
                   help="who restarts dead NN ranks: the launcher (it restarts the training "
                        "roles from the last checkpoint) or torchrun (--max-restarts; the "
                        "restarted ranks rewind the data loaders and embedding workers "
                        "themselves, as on Kubernetes)")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="answer predictions over gRPC from a checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="checkpoint root (its LATEST) or one checkpoint folder")
    p.add_argument("--wait", action="store_true",
                   help="if --checkpoint holds no checkpoint yet (the folder is missing or "
                        "empty: training has not written its first one), wait until the "
                        "first one is complete, then serve it; SIGTERM or Ctrl-C stops the "
                        "wait (default: exit with a message)")
    p.add_argument("--embedding-config", required=True, help="embedding_config.yml")
    p.add_argument("--global-config", default=None,
                   help="global_config.yml (default: all defaults)")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="callable that builds the dense model (module name or .py file, then "
                        "the attribute), e.g. examples/criteo_synthetic/model.py:DLRM")
    p.add_argument("--port", type=int, default=0,
                   help="port of the Serving service (0: any free port)")
    p.add_argument("--bind", default="127.0.0.1", help="address every server binds")
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server replicas")
    p.add_argument("--device-id", type=int, default=None,
                   help="CUDA device of the dense model (default: cuda:LOCAL_RANK where "
                        "CUDA is available, else the CPU)")
    _add_dir_flag(p, "--follow-increments",
                  "the parameter servers apply the training job's incremental exports "
                  "in DIR (checkpoint_config.incremental_dir) as they appear")
    _add_dir_flag(p, "--follow-dense",
                  "swap in each new dense model version the training job writes to DIR "
                  "(checkpoint_config.dense_export_dir), atomically")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics (dense model freshness) on this port (0: any "
                        "free port); the parameter servers then serve theirs (increment "
                        "freshness) on free ports, each printed at start-up")
    add_insecure_flag(p, "the Serving service and its servers")
    add_insecure_token_flag(p)


def _k8s_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="render Kubernetes manifests for a job")
    from persia_py.launcher.job_flags import add_job_flags
    from persia_py.launcher.k8s_flags import add_k8s_flags

    add_job_flags(p, nn_node="pod", in_image=True)
    add_k8s_flags(p)


def _slurm_parser(sub: argparse._SubParsersAction) -> None:
    _add_slurm_flags(sub.add_parser(
        "slurm", help="render (and submit) a Slurm batch script for a job"), render=True)


def _slurm_run_parser(sub: argparse._SubParsersAction) -> None:
    _add_slurm_flags(sub.add_parser(
        "slurm-run", help="run a job inside its Slurm allocation (the batch script "
                          "persia-launcher slurm renders calls it)"), render=False)


def _add_slurm_flags(p: argparse.ArgumentParser, *, render: bool) -> None:
    """``slurm``'s flags (``render``: and the script's own) or ``slurm-run``'s."""
    from persia_py.launcher.job_flags import add_job_flags, add_supervisor_flags
    from persia_py.launcher.slurm import add_slurm_flags

    add_job_flags(p, nn_node="node")
    add_supervisor_flags(p, "a new token per run, in RUN_DIR/auth_token, mode 0600, handed "
                            "to the roles by Slurm")
    add_slurm_flags(p, render=render)


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="size a job: parameter servers, memory, workers, disk")
    from persia_py.launcher.plan_cli import add_plan_flags

    add_plan_flags(p)


def _plot_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw loss, AUC and throughput from a training log")
    p.add_argument("log", help="JSON-lines training log (train_log.jsonl)")
    p.add_argument("-o", "--output", default="curves.png", help="PNG to write")


def main(argv: list[str] | None = None) -> int:
    from persia_py.launcher.lifeline import watch_lifeline

    # Started by a launcher: this role (and all it starts) stops when that launcher dies.
    watch_lifeline()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from persia_py.launcher import roles

    if getattr(args, "insecure_token", False):
        # Read by every token check in this process and in those it starts.
        os.environ[ENV_INSECURE_TOKEN] = "1"
    try:
        _check_environment()
        code = _SUBCOMMANDS[args.command].run(args)
    except ConfigError as exc:
        # Final: a supervisor that restarted the role would meet the same error.
        print(f"persia-launcher {args.command}: config error: {exc}", file=sys.stderr)
        code = CONFIG_EXIT_CODE
    if code in (CONFIG_EXIT_CODE, DATA_EXIT_CODE) and getattr(args, "hold_on_config_error",
                                                           False):
        # The role's own config error (above), or its script's (a data loader's code):
        # a restart would meet it again.
        return roles.hold_after_config_error(args.command, code)
    return code


def _check_environment() -> None:
    """Settings this process and the ones it starts read from the environment, checked
    before anything starts."""
    try:
        huge_pages.choice()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _run_role_from_flags(args: argparse.Namespace) -> int:
    """A role (or ``serve``): refused without a job token unless ``--insecure``."""
    from persia_py.launcher import roles
    from persia_py.launcher.role_options import role_options_from_flags

    options = role_options_from_flags(args)
    roles.require_token(options)
    return _run_role(options)


def _run_role(options: RoleOptions) -> int:
    """Run the role (or ``serve``) that ``options`` are of."""
    from persia_py.launcher import roles
    from persia_py.launcher.role_options import (
        DataLoaderOptions,
        EmbeddingWorkerOptions,
        NNWorkerOptions,
        ParameterServerOptions,
        ServeOptions,
    )

    if isinstance(options, ParameterServerOptions):
        return roles.run_parameter_server(options)
    if isinstance(options, EmbeddingWorkerOptions):
        return roles.run_embedding_worker(options)
    if isinstance(options, NNWorkerOptions):
        return roles.run_nn_worker(options)
    if isinstance(options, DataLoaderOptions):
        return roles.run_data_loader(options)
    assert isinstance(options, ServeOptions), options
    from persia_py.launcher.serve import run_serve  # imports torch: only this command pays for it

    return run_serve(options)


def _run_local(args: argparse.Namespace) -> int:
    from persia_py.launcher.job_flags import local_from_flags
    from persia_py.launcher.job_run import run_local

    return run_local(*local_from_flags(args))


def _run_k8s(args: argparse.Namespace) -> int:
    from persia_py.launcher.job_flags import k8s_from_flags
    from persia_py.launcher.k8s import run_k8s

    return run_k8s(k8s_from_flags(args), args.output)


def _run_slurm(args: argparse.Namespace) -> int:
    from persia_py.launcher.job_flags import slurm_from_flags

    spec, options = slurm_from_flags(args)
    if args.command == "slurm":
        from persia_py.launcher.slurm import run_slurm

        return run_slurm(spec, args.output, args.submit)
    from persia_py.launcher.slurm_run import run_in_allocation

    return run_in_allocation(spec, options)


def _run_plan(args: argparse.Namespace) -> int:
    from persia_py.launcher.plan_cli import run_plan
    from persia_py.launcher.role_options import plan_options_from_flags

    return run_plan(plan_options_from_flags(args))


def _run_plot(args: argparse.Namespace) -> int:
    from persia_py.launcher.plot import plot_training_log

    plot_training_log(args.log, args.output)
    print(f"wrote {args.output}")
    return 0


@dataclass(frozen=True)
class _Subcommand:
    add: Callable[[argparse._SubParsersAction], None]
    """Adds its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it from its flags; its exit code."""


_SUBCOMMANDS = {
    "embedding-parameter-server": _Subcommand(_parameter_server_parser, _run_role_from_flags),
    "embedding-worker": _Subcommand(_embedding_worker_parser, _run_role_from_flags),
    "nn-worker": _Subcommand(_nn_worker_parser, _run_role_from_flags),
    "data-loader": _Subcommand(_data_loader_parser, _run_role_from_flags),
    "local": _Subcommand(_local_parser, _run_local),
    "serve": _Subcommand(_serve_parser, _run_role_from_flags),
    "k8s": _Subcommand(_k8s_parser, _run_k8s),
    "slurm": _Subcommand(_slurm_parser, _run_slurm),
    "slurm-run": _Subcommand(_slurm_run_parser, _run_slurm),
    "plan": _Subcommand(_plan_parser, _run_plan),
    "plot": _Subcommand(_plot_parser, _run_plot),
}
"""Every subcommand, in ``--help``'s order: how its parser is made and how it runs (the
roles and ``serve`` refuse to start without a job token unless ``--insecure``)."""

if __name__ == "__main__":
    sys.exit(main())
