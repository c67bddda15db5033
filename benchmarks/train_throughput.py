"""Training throughput: persia_py through ``persia-launcher local`` (1 PS, 1 embedding
worker, 1 NN worker, 1 data loader) beside the same model in one plain PyTorch process,
measured in the same run.

    python -m benchmarks.train_throughput [--steps N] [--repeats R] [--json PATH] [--smoke]

Prints samples/s of both sides and their ratio for the dense-heavy and embedding-heavy
workloads (medians over repeats), then samples/s for embedding staleness 1, 2, 4, 8 on
the embedding-heavy workload. Embeddings and gradients travel as float16 unless
``--fp32-wire``; both sides train on batches built before their clocks start, and both
clocks start after the same warm-up steps (``workloads.WARMUP_STEPS``). For each workload it
also prints the core-seconds per 1,000 samples of every role (parameter server, embedding
worker, data loader, NN worker, launcher; ``benchmarks.role_cpu``) beside plain PyTorch's,
over the same timed window; ``--json`` adds ``<workload>_cpu_ratio`` (all roles over plain).

Runs are long enough to pass the start-up phase: in a run's first tens of steps the
parameter server inserts most of the rows it will hold (new memory, touched for the first
time), while the plain process allocates and fills its whole tables before its clock
starts. ``--steps 40`` shows that phase. (Dense-heavy's Zipf tail over 1M ids per slot
keeps bringing ~18k new ids per step to the end of a run; embedding-heavy stops inserting
after ~100 steps.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import parse_args_with_smoke
from benchmarks.role_cpu import ROLES, JobResult, run_job

HERE = Path(__file__).resolve().parent / "throughput"
sys.path.insert(0, str(HERE))
from workloads import SLOT_NAMES, SMOKE_WARMUP_STEPS, WARMUP_STEPS, WORKLOADS  # noqa: E402

TARGETS = {"dense_heavy": 1.0, "embedding_heavy": 1.6}
"""Issue 29's bars, throughput over plain PyTorch's (TorchRec's reach on these
workloads); embedding-heavy also at <= 0.6x plain's CPU per sample."""


def _configs(workdir: Path, workload: str, fp16: bool = True,
             max_message_bytes: int | None = None, shared_memory: bool = True
             ) -> tuple[Path, Path]:
    w = WORKLOADS[workload]
    embedding = workdir / f"{workload}_embedding_config.yml"
    embedding.write_text("slots_config:\n" + "".join(
        f"  {name}:\n    dim: {w.dim}\n" for name in SLOT_NAMES))
    global_ = workdir / "global_config.yml"
    limit = "" if max_message_bytes is None else f"  max_message_bytes: {max_message_bytes}\n"
    shm = "" if shared_memory else "  shared_memory: false\n"
    global_.write_text(f"common_config:\n  embedding_fp16: {str(fp16).lower()}\n{limit}{shm}"
                       "embedding_parameter_server_config:\n  capacity: 100000000\n"
                       "embedding_worker_config:\n  forward_buffer_size: 64\n")
    return embedding, global_


def numba_cache_dir(tree: Path) -> str:
    """Where the job's processes keep numba's compiled kernels of ``tree``'s sources as
    they are now: a directory named by every source file's path, size and time.

    numba checks a cached kernel against its own file only, so a kernel whose callee in
    another file changed runs the callee's old machine code: an edited tree measured
    with a cache its last version left would run code no longer there."""
    digest = hashlib.sha256()
    for sub in ("persia_py", "servers", "workers"):
        for path in sorted((tree / sub).rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return str(Path(tempfile.gettempdir()) / "persia-benchmark-numba" / digest.hexdigest()[:20])


def ours(workload: str, steps: int, staleness: int, workdir: Path, fp16: bool = True,
         tree: Path | None = None, smoke: bool = False, *, launcher_args: Sequence[str] = (),
         script_args: str = "", nn_args: str = "", loader_args: str = "",
         own_network: bool = False, max_message_bytes: int | None = None,
         shared_memory: bool = True) -> JobResult:
    """One ``local`` job of ``workload`` (its tiny version if ``smoke``); ``tree``: the
    checkout whose persia_py runs it (default: the one installed), the harness being this
    one either way, with numba's kernels cached by the state of its sources
    (:func:`numba_cache_dir`) unless ``smoke``. ``launcher_args`` go to ``persia-launcher
    local`` (the roles' counts), ``script_args`` to both scripts (the workload's sizes),
    ``nn_args`` to the NN worker's and ``loader_args`` to the data loader's
    (``benchmarks.scaling``'s); ``own_network``: see ``role_cpu.run_job``;
    ``max_message_bytes``: ``common_config``'s, for batches whose lookup answers could
    pass the default; ``shared_memory``: ``common_config``'s (off: every array in the
    messages, as between roles on different hosts)."""
    tiny = "".join(f" {a}" for a in ("--smoke" if smoke else "", script_args) if a)
    embedding, global_ = _configs(workdir, workload, fp16, max_message_bytes, shared_memory)
    env = None
    if tree is not None:  # a comparison's side: measured code only (a smoke checks it runs)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        if not smoke:
            env["NUMBA_CACHE_DIR"] = numba_cache_dir(tree)
    run_dir = workdir / "run"  # holds update logs of GBs in trees that kept them
    try:
        return run_job([
            sys.executable, "-m", "persia_py.launcher.cli", "local", "--run-dir", str(run_dir),
            "--nn-worker", str(HERE / "train.py"), "--data-loader", str(HERE / "data_loader.py"),
            "--embedding-config", str(embedding), "--global-config", str(global_),
            *launcher_args, "--nn-worker-args",
            f"--workload {workload} --embedding-staleness {staleness}{tiny} {nn_args}".rstrip(),
            "--data-loader-args",
            f"--workload {workload} --steps {steps}{tiny} {loader_args}".rstrip(),
        ], cwd=str(HERE), env=env, what=f"persia_py {workload}", train_script="train.py",
            loader_script="data_loader.py", own_network=own_network)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def plain(workload: str, steps: int, smoke: bool = False) -> tuple[float, float]:
    """samples/s and core-seconds per 1,000 samples of the plain PyTorch process (the
    workload's tiny version if ``smoke``)."""
    command = [sys.executable, str(HERE / "plain.py"), "--workload", workload,
               "--steps", str(steps), *(["--smoke"] if smoke else [])]
    result = subprocess.run(command, capture_output=True, text=True, cwd=HERE)
    match = re.search(r"samples_per_sec: ([0-9.]+) samples: ([0-9]+) cpu_sec: ([0-9.]+)",
                      result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"plain PyTorch {workload} failed ({result.returncode}):\n"
                           f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return float(match.group(1)), 1000 * float(match.group(3)) / int(match.group(2))


def median_cpu(runs: list[JobResult]) -> dict[str, float]:
    """Per role (and ``all``), the median over runs of core-seconds per 1,000 samples."""
    per_run = [r.cpu_per_1000() for r in runs]
    return {role: statistics.median(p[role] for p in per_run) for role in (*ROLES, "all")}


def cpu_line(cpu: dict[str, float]) -> str:
    return "  ".join(f"{role} {cpu[role]:.3f}" for role in (*ROLES, "all"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200,
                        help=f"batches per run, the first {WARMUP_STEPS} not timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staleness", type=int, default=4, help="staleness of the main runs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--sweep", default="1,2,4,8",
                        help="embedding staleness values of the embedding-heavy sweep "
                             "(comma-separated; empty: none)")
    parser.add_argument("--fp32-wire", action="store_true",
                        help="send embeddings and gradients as float32 (default: float16)")
    parser.add_argument("--json", default=None, help="write every figure here")
    # The smoke runs one job: ``compare --smoke`` runs the other workload's.
    args = parse_args_with_smoke(parser, argv, steps=SMOKE_WARMUP_STEPS + 3, repeats=1,
                                 workloads="embedding_heavy", sweep="")
    warmup = SMOKE_WARMUP_STEPS if args.smoke else WARMUP_STEPS
    if args.steps <= warmup:
        parser.error(f"--steps must be more than the {warmup} warm-up steps")
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}, got {args.workloads!r}")
    sweep = [int(s) for s in args.sweep.split(",") if s]
    fp16 = not args.fp32_wire
    figures: dict[str, float | list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for workload in workloads:
            ours_runs, plain_runs = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
                plain_runs.append(plain(workload, args.steps, args.smoke))
                ours_runs.append(ours(workload, args.steps, args.staleness, workdir, fp16,
                                      smoke=args.smoke))
            o = statistics.median(r.samples_per_sec for r in ours_runs)
            p = statistics.median(sps for sps, _ in plain_runs)
            cpu, plain_cpu = median_cpu(ours_runs), statistics.median(c for _, c in plain_runs)
            figures.update({
                f"{workload}_runs_samples_per_sec": [r.samples_per_sec for r in ours_runs],
                f"{workload}_plain_runs_samples_per_sec": [sps for sps, _ in plain_runs],
                f"{workload}_samples_per_sec": o,
                f"{workload}_plain_samples_per_sec": p,
                f"{workload}_ratio": o / p,
                f"{workload}_cpu_per_1000_samples": cpu,
                f"{workload}_plain_cpu_per_1000_samples": plain_cpu,
                f"{workload}_cpu_ratio": cpu["all"] / plain_cpu})
            print(f"{workload:16s} persia_py {o:10.0f} samples/s   plain PyTorch {p:10.0f} "
                  f"samples/s   ratio {o / p:5.2f}   (target >= {TARGETS[workload]})", flush=True)
            print(f"{'':16s} core-s per 1,000 samples: {cpu_line(cpu)}   plain PyTorch "
                  f"{plain_cpu:.3f}   ratio {cpu['all'] / plain_cpu:5.2f}", flush=True)
        for staleness in sweep:
            s = ours("embedding_heavy", args.steps, staleness, workdir, fp16,
                     smoke=args.smoke).samples_per_sec
            figures[f"embedding_heavy_staleness_{staleness}_samples_per_sec"] = s
            print(f"embedding_heavy  staleness {staleness}: {s:10.0f} samples/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
