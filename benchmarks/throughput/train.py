"""NN worker of the throughput benchmark: prints ``timing_started`` after the warm-up
steps and ``samples_per_sec: <value> samples: <count>`` at the end (``benchmarks.role_cpu``
reads every role's CPU between the two lines), before it the median and 99th percentile of
its timed steps' wall times (``figures: step_ms_p50=... step_ms_p99=...``: from taking a
batch to taking the next, its wait for the batch's embeddings and its forward and backward
included)."""

import argparse
import time

import numpy as np
import torch
from workloads import SMOKE_WARMUP_STEPS, WARMUP_STEPS, WORKLOADS, add_size_options, sized

from persia_py.ctx import TrainCtx
from persia_py.data import DataLoader, StreamingDataset
from persia_py.embedding.optim import Adagrad

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--smoke", action="store_true", help="the workload's tiny version")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed steps (default {WARMUP_STEPS}, {SMOKE_WARMUP_STEPS} "
                             "with --smoke)")
    parser.add_argument("--embedding-staleness", type=int, default=4)
    add_size_options(parser)
    args = parser.parse_args()
    w = sized(args)
    if args.warmup is None:
        args.warmup = SMOKE_WARMUP_STEPS if args.smoke else WARMUP_STEPS
    torch.manual_seed(0)
    model = w.model()
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.01),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.01)) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=8),
                            embedding_staleness=args.embedding_staleness)
        samples, start, taken = 0, None, []
        for step, batch in enumerate(loader):
            if step == args.warmup:
                start = time.perf_counter()
                print("timing_started", flush=True)  # the CPU-per-role window opens
            if start is not None:
                samples += batch.batch_size
                taken.append(time.perf_counter())
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        ctx.flush()
        end = time.perf_counter()
        elapsed = end - start
        step_ms = 1000 * np.diff([*taken, end])
        print(f"figures: step_ms_p50={np.percentile(step_ms, 50):.3f} "
              f"step_ms_p99={np.percentile(step_ms, 99):.3f}", flush=True)
        print(f"samples_per_sec: {samples / elapsed:.1f} samples: {samples} staleness_mean: "
              f"{ctx.mean_staleness:.2f}", flush=True)
