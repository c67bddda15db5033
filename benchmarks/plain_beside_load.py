"""Plain PyTorch's own throughput when another process shares its cores.

    python -m benchmarks.plain_beside_load [--workload dense_heavy] [--share 0.4]
                                           [--repeats 3] [--steps 200] [--json PATH] [--smoke]

Runs ``benchmarks/throughput/plain.py`` alone and beside a process that keeps ``--share``
of one core busy in short bursts (2 ms busy per ``2 / share`` ms), alternately, and
prints both medians and their ratio. The burst pattern stands for the roles a
``persia-launcher local`` job runs beside its NN worker (parameter server, embedding
worker and data loader, which together use about 0.4 of a core on the dense-heavy
workload, [Training throughput](../docs/benchmarks.md#training-throughput)): it shows
what sharing two cores with them costs a two-thread ``sgemm``, whoever does the
embedding work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks import parse_args_with_smoke
from benchmarks.train_throughput import SMOKE_WARMUP_STEPS, plain

BURST_S = 0.002


def busy(share: float) -> None:
    """Forever: ``BURST_S`` of spinning, then the sleep that makes it ``share`` of a core."""
    pause = BURST_S * (1.0 - share) / share
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:
            pass
        time.sleep(pause)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="dense_heavy")
    parser.add_argument("--share", type=float, default=0.4, help="of one core, in (0, 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--busy", type=float, default=None, help=argparse.SUPPRESS)
    args = parse_args_with_smoke(parser, argv, repeats=1, steps=SMOKE_WARMUP_STEPS + 2)
    if args.busy is not None:  # the process beside plain PyTorch
        busy(args.busy)
    if not 0.0 < args.share < 1.0:
        parser.error("--share must be in (0, 1)")
    alone: list[float] = []
    beside: list[float] = []
    for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
        alone.append(plain(args.workload, args.steps, args.smoke)[0])
        burner = subprocess.Popen([sys.executable, "-m", "benchmarks.plain_beside_load",
                                   "--busy", str(args.share)])
        try:
            beside.append(plain(args.workload, args.steps, args.smoke)[0])
        finally:
            burner.kill()
            burner.wait()
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"{args.workload}: plain PyTorch alone {a:.0f} samples/s, beside {args.share:.2f} of a "
          f"core kept busy {b:.0f} samples/s, ratio {b / a:.2f}  (runs: alone "
          f"{[round(x) for x in alone]}, beside {[round(x) for x in beside]})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"alone_samples_per_sec": a, "beside_samples_per_sec": b,
                       "ratio": b / a, "share": args.share, "alone_runs": alone,
                       "beside_runs": beside}, f, indent=1)


if __name__ == "__main__":
    main()
