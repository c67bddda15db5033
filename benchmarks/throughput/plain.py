"""The baseline: the same model in one plain PyTorch process.

``nn.EmbeddingBag(sparse=True)`` per slot with ``torch.optim.Adagrad`` for the embeddings
and SGD for the dense part. Batches are generated before the clock starts, which favours
the baseline (ours generates them in the data-loader process while training).
"""

import argparse
import time

import torch
from torch import nn
from workloads import NUM_SLOTS, SMOKE_WARMUP_STEPS, WARMUP_STEPS, WORKLOADS, workload

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--smoke", action="store_true", help="the workload's tiny version")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed steps (default {WARMUP_STEPS}, {SMOKE_WARMUP_STEPS} "
                             "with --smoke)")
    args = parser.parse_args()
    w = workload(args.workload, args.smoke)
    if args.warmup is None:
        args.warmup = SMOKE_WARMUP_STEPS if args.smoke else WARMUP_STEPS
    torch.manual_seed(0)
    model = w.model()
    tables = nn.ModuleList(nn.EmbeddingBag(w.vocab, w.dim, mode="sum", sparse=True)
                           for _ in range(NUM_SLOTS))
    for t in tables:
        nn.init.uniform_(t.weight, -0.01, 0.01)
    embedding_optimizer = torch.optim.Adagrad(tables.parameters(), lr=0.01)
    dense_optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    offsets = torch.arange(0, w.batch_size * w.ids_per_slot, w.ids_per_slot)
    batches = []
    for i in range(args.steps):
        dense, ids, labels = w.batch(i)
        batches.append((torch.from_numpy(dense), [torch.from_numpy(x.astype("int64")) for x in ids],
                        torch.from_numpy(labels)))
    samples, start = 0, None
    for step, (dense, ids, labels) in enumerate(batches):
        if step == args.warmup:
            start, cpu_start = time.perf_counter(), time.process_time()
        if start is not None:
            samples += w.batch_size
        embeddings = [t(x, offsets) for t, x in zip(tables, ids)]
        loss = nn.functional.binary_cross_entropy(model([dense], embeddings), labels)
        embedding_optimizer.zero_grad()
        dense_optimizer.zero_grad()
        loss.backward()
        embedding_optimizer.step()
        dense_optimizer.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"samples_per_sec: {samples / elapsed:.1f} samples: {samples} cpu_sec: {cpu:.3f}",
          flush=True)
