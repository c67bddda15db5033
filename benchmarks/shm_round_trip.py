"""CPU of one embedding-heavy batch's round trip between an NN worker and its embedding
worker, with the arrays in shared memory and in the messages, alternately.

    python -m benchmarks.shm_round_trip [--rounds N] [--batches N] [--json PATH] [--smoke]

Starts a parameter server and an embedding worker (the launcher's roles, this host) and,
in this process, two clients of the embedding worker: ``common_config.shared_memory``
on and off. Each round runs ``--batches`` batches of the embedding-heavy workload
(``benchmarks/throughput/workloads.py``: 26 slots x 20 ids x batch 1024, dim 32, float16
on the wire; ``--smoke``: its tiny version) through one client, then as many through the
other (the order alternating by round): put, lookup, gradients back. It prints, per side,
the median over rounds of the CPU seconds per batch of the embedding worker process, of this process (the NN
worker's side: decoding the answer, encoding the gradients) and of the parameter server,
and their ratio (shared memory / messages). CPU seconds, not wall time: a loaded machine
moves them less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from benchmarks.density import cpu_seconds
from benchmarks.throughput.workloads import SLOT_NAMES, workload
from persia_py.config import CommonConfig
from persia_py.wire.security import ENV_AUTH_TOKEN
from persia_py.workers.embedding_worker_service import EmbeddingWorkerClient
from persia_py.workers.ps_client import configure_request


def _start(role: str, *args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "persia_py.launcher.cli", role, "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if match := re.search(r"on port (\d+) ready", line):
            return proc, int(match.group(1))
    raise RuntimeError(f"{role} ended before it was ready (exit {proc.wait()})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parse_args_with_smoke(parser, argv, rounds=1, batches=2)
    w = workload("embedding_heavy", smoke=args.smoke)
    # Authenticated calls, as in a job: a token for the roles and the clients.
    os.environ.setdefault(ENV_AUTH_TOKEN, secrets.token_hex(32))
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "embedding_config.yml"
        config.write_text("slots_config:\n" + "".join(
            f"  {name}:\n    dim: {w.dim}\n" for name in SLOT_NAMES))
        try:
            ps, ps_port = _start("embedding-parameter-server", "--embedding-config", str(config))
            procs.append(ps)
            ew, ew_port = _start("embedding-worker", "--embedding-config", str(config),
                                 "--ps-addrs", f"127.0.0.1:{ps_port}")
            procs.append(ew)
            clients = {on: EmbeddingWorkerClient(f"127.0.0.1:{ew_port}", CommonConfig(
                embedding_fp16=True, shared_memory=on)) for on in (True, False)}
            clients[True].configure(configure_request(
                {"type": "adagrad", "lr": 0.01}, init_lower=-0.01, init_upper=0.01,
                weight_bound=None, seed=1))
            results = _measure(clients, w, ps.pid, ew.pid, args)
            for c in clients.values():
                c.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
    print(f"{'core-s per batch (median of rounds)':40s} {'shared memory':>14s} "
          f"{'messages':>10s} {'ratio':>6s}")
    figures: dict[str, object] = {"rounds": args.rounds, "batches": args.batches}
    for role in ("embedding worker", "NN worker side", "parameter server"):
        on = statistics.median(results[True][role])
        off = statistics.median(results[False][role])
        # A tiny batch can take less than a clock tick of CPU: no ratio then.
        ratio = on / off if off else float("nan")
        print(f"{role:40s} {on:14.4f} {off:10.4f} {ratio:6.2f}")
        key = role.replace(" ", "_")
        figures.update({f"{key}_shm_cpu_s_per_batch": on, f"{key}_messages_cpu_s_per_batch": off})
    figures.update(shm_lookups=clients[True].num_shm_lookups,
                   shm_updates=clients[True].num_shm_updates)
    print(f"lookups through shared memory: {clients[True].num_shm_lookups}, "
          f"updates: {clients[True].num_shm_updates}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


def _measure(clients, w, ps_pid: int, ew_pid: int, args) -> dict[bool, dict[str, list[float]]]:
    results: dict[bool, dict[str, list[float]]] = {
        on: {"embedding worker": [], "NN worker side": [], "parameter server": []}
        for on in clients}
    batches = [w.batch(i) for i in range(args.batches)]
    for on in (True, False):  # warm-up: rows inserted, segments sized, pages touched
        _run(clients[on], batches[:2], w)
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            before = cpu_seconds(ew_pid), time.process_time(), cpu_seconds(ps_pid)
            _run(clients[on], batches, w)
            after = cpu_seconds(ew_pid), time.process_time(), cpu_seconds(ps_pid)
            for role, b, a in zip(results[on], before, after):
                results[on][role].append((a - b) / len(batches))
    return results


def _run(client: EmbeddingWorkerClient, batches, w) -> None:
    lengths = np.full(w.batch_size, w.ids_per_slot, np.int32)
    for _, ids, _ in batches:
        ref = client.put_batch([(name, i, lengths) for name, i in zip(SLOT_NAMES, ids)],
                               w.batch_size, True)
        slots = client.lookup(ref)
        client.update_gradients(ref, [(s.slot, np.full_like(s.rows, 1e-3)) for s in slots])


if __name__ == "__main__":
    main()
