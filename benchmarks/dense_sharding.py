"""Dense sharding: a >= 100M-parameter tower trained with DDP and with FSDP on 2 CPU ranks.

    python -m benchmarks.dense_sharding [--width 4096] [--layers 6] [--steps 6] [--json PATH]
                                        [--smoke]

The same deep MLP (``layers`` Linear(width, width) + ReLU; 6 x 4096^2 ~ 100.7M parameters)
with Adagrad is trained by 2 gloo ranks, first wrapped by ``DDPOption`` (the baseline, a
replica per rank), then by ``FSDPOption(max_unsharded_bytes=2 units)``, each mode in
fresh processes. DDP builds the tower as usual; FSDP builds it with
``persia_py.distributed.build_on_meta`` (parameters on the meta device, initialized and
sharded one unit at a time by ``FSDPOption.wrap``, to the same values), so no rank ever
holds the whole tower (``--fsdp-whole-build`` builds it whole first, as before, for the
comparison). Figures: per-rank peak resident memory (``ru_maxrss``), samples/s (after
one warm-up step), and FSDP's measured peak of unsharded bytes against its bound. The
dense step alone: the embeddings (on the parameter servers) are the same in both modes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import resource
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks import parse_args_with_smoke
from persia_py.distributed import DDPOption, FSDPOption, build_on_meta


def _tower(width: int, layers: int) -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, mode: str, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks share the 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    if mode == "fsdp" and not args.fsdp_whole_build:
        model = build_on_meta(_tower, args.width, args.layers)
    else:
        model = _tower(args.width, args.layers)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    if mode == "ddp":
        option = DDPOption()
    else:
        sizes, _ = FSDPOption().sizes(model, 2)
        option = FSDPOption(max_unsharded_bytes=2 * max(sizes))
    # No Join here (both ranks run every step): the shadow step is never called.
    parallel = option.wrap(model, optimizer, torch.device("cpu"),
                           shadow_step=lambda dense, embeddings: None)
    x = torch.randn(args.batch_size, args.width)
    elapsed = 0.0
    for step in range(args.steps + 1):
        started = time.perf_counter()
        loss = parallel.module(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        parallel.after_step()
        if step:  # the first step warms up (allocations, FSDP's lazy init)
            elapsed += time.perf_counter() - started
    meter = getattr(parallel, "meter", None)
    results.put({"mode": mode, "rank": rank,
                 "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "samples_per_sec": args.steps * args.batch_size / elapsed,
                 "peak_unsharded_bytes": None if meter is None else meter.peak,
                 "max_unsharded_bytes": None if meter is None else meter.bound})
    dist.destroy_process_group()


def _run(mode: str, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, mode, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = []
        deadline = time.monotonic() + args.timeout
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                # A rank that died before its results would leave the other one waiting
                # in a collective, and this process until the timeout.
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{mode} rank exited with {failed[0]}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode} ranks gave no results within "
                                       f"{args.timeout:.0f} s") from None
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{mode} rank exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=30)
    return sorted(out, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after one warm-up")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mode")
    parser.add_argument("--fsdp-whole-build", action="store_true",
                        help="FSDP ranks build the whole tower before sharding it")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parse_args_with_smoke(parser, argv, width=64, layers=2, batch_size=4, steps=1,
                                 timeout=300)
    num_params = sum(p.numel() for p in _tower(args.width, args.layers).parameters())
    ddp, fsdp = _run("ddp", args), _run("fsdp", args)
    ddp_rss = max(r["peak_rss_bytes"] for r in ddp)
    fsdp_rss = max(r["peak_rss_bytes"] for r in fsdp)
    ddp_sps = min(r["samples_per_sec"] for r in ddp)
    fsdp_sps = min(r["samples_per_sec"] for r in fsdp)
    figures = {
        "num_params": num_params, "ranks": 2, "batch_size_per_rank": args.batch_size,
        "steps": args.steps, "fsdp_build": "whole" if args.fsdp_whole_build else "meta",
        "ddp_peak_rss_bytes": ddp_rss, "fsdp_peak_rss_bytes": fsdp_rss,
        "fsdp_rss_ratio": fsdp_rss / ddp_rss,
        "ddp_samples_per_sec": ddp_sps, "fsdp_samples_per_sec": fsdp_sps,
        "fsdp_throughput_ratio": fsdp_sps / ddp_sps,
        "fsdp_peak_unsharded_bytes": max(r["peak_unsharded_bytes"] for r in fsdp),
        "fsdp_max_unsharded_bytes": fsdp[0]["max_unsharded_bytes"],
        "per_rank": ddp + fsdp,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    for key in ("num_params", "ddp_peak_rss_bytes", "fsdp_peak_rss_bytes", "fsdp_rss_ratio",
                "ddp_samples_per_sec", "fsdp_samples_per_sec", "fsdp_throughput_ratio",
                "fsdp_peak_unsharded_bytes", "fsdp_max_unsharded_bytes"):
        value = figures[key]
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
