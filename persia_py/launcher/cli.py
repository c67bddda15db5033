"""The ``persia-launcher`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from persia_py.config import ConfigError


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: any free port)")
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; use 0.0.0.0 to serve other hosts)")
    p.add_argument("--replica-index", type=int, default=0, help="index of this replica")
    p.add_argument("--replica-size", type=int, default=1, help="number of replicas of this role")
    _add_config_flags(p)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-config", default=None,
                   help="global_config.yml (default: $PERSIA_GLOBAL_CONFIG, else all defaults)")
    p.add_argument("--embedding-config", default=None,
                   help="embedding_config.yml (default: $PERSIA_EMBEDDING_CONFIG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="persia-launcher",
        description="Launch the roles of a persia_py training job.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("embedding-parameter-server", help="serve a shard of the embedding tables")
    _add_server_flags(p)

    p = sub.add_parser("embedding-worker", help="dedup, route and pool embedding lookups")
    _add_server_flags(p)
    p.add_argument("--ps-addrs", default=None,
                   help="comma-separated parameter-server addresses (default: $PERSIA_PS_ADDRS)")

    p = sub.add_parser("nn-worker", help="run a training script under torchrun")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    _add_config_flags(p)

    p = sub.add_parser("data-loader", help="run a data-loader script")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.add_argument("--port", type=int, default=0, help="port to serve NN workers on")
    p.add_argument("--replica-index", type=int, default=0)
    p.add_argument("--replica-size", type=int, default=1)
    _add_config_flags(p)

    p = sub.add_parser("local", help="run a whole job on this machine")
    p.add_argument("--nn-worker", required=True, help="training script")
    p.add_argument("--data-loader", required=True, help="data-loader script")
    p.add_argument("--nn-worker-args", default="", help="arguments of the training script")
    p.add_argument("--data-loader-args", default="", help="arguments of the data-loader script")
    p.add_argument("--embedding-config", required=True)
    p.add_argument("--global-config", default=None)
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server replicas")
    p.add_argument("--num-embedding-workers", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=1, help="NN-worker ranks")
    p.add_argument("--num-data-loaders", type=int, default=1)
    p.add_argument("--bind", default="127.0.0.1", help="address every server binds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every process (repeatable)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a job from its last checkpoint in DIR (a checkpoint root or "
                        "folder): the NN workers load it, the data loaders skip the batches "
                        "it had trained")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from persia_py.launcher import local, roles

    run = {
        "embedding-parameter-server": roles.run_parameter_server,
        "embedding-worker": roles.run_embedding_worker,
        "nn-worker": roles.run_nn_worker,
        "data-loader": roles.run_data_loader,
        "local": local.run_local,
    }[args.command]
    try:
        return run(args)
    except ConfigError as exc:
        print(f"persia-launcher {args.command}: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
