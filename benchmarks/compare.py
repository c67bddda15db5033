"""Paired A/B of the training throughput job: a git ref against the working tree.

    python -m benchmarks.compare REF [--workload embedding_heavy|dense_heavy|both]
                                     [--pairs N] [--steps N] [--staleness S] [--num-ps N]
                                     [--json PATH]
    python -m benchmarks.compare --smoke [REF]     # HEAD by default; one tiny pair

Checks REF out into a temporary git worktree and runs ``benchmarks.train_throughput``'s
job alternately with REF's persia_py and with the working tree's (same Python
environment, nothing installed; the harness, workloads and measurement are this tree's
for both, so only the library differs; each side's numba kernels are compiled for the
state of its sources, never taken from a cache an earlier state left:
``train_throughput.numba_cache_dir``). Prints, per workload, the samples/s medians and
their ratio (working tree / REF), and core-seconds per 1,000 samples per role for both.
``--json`` writes ``throughput_ratio`` and ``cpu_per_sample_ratio`` (working tree / REF,
all roles; of the first workload) beside every figure per workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks import parse_args_with_smoke
from benchmarks.role_cpu import JobResult
from benchmarks.train_throughput import ROLES, SMOKE_WARMUP_STEPS, cpu_line, median_cpu, ours

REPO = Path(__file__).resolve().parent.parent


def checkout(ref: str, into: Path) -> Path:
    """REF in a detached worktree at ``into``, importable as ``persia_py`` from there."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force",
                    str(into), ref], check=True, capture_output=True, text=True)
    for sub in ("servers", "workers"):  # trees that mapped them with setup.cfg package_dir
        inside = into / "persia_py" / sub
        if (into / sub).is_dir() and not inside.exists():
            inside.symlink_to(into / sub, target_is_directory=True)
    return into


def remove(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                   capture_output=True)


def compare(ref_tree: Path, workload: str, args: argparse.Namespace,
            workdir: Path) -> dict[str, object]:
    runs: dict[str, list[JobResult]] = {"ref": [], "tree": []}
    for i in range(args.pairs):  # A B B A ...: drift and warm caches hit both sides alike
        order = ("ref", "tree") if i % 2 == 0 else ("tree", "ref")
        for side in order:
            tree = ref_tree if side == "ref" else REPO
            result = ours(workload, args.steps, args.staleness, workdir, tree=tree,
                          smoke=args.smoke, launcher_args=["--num-ps", str(args.num_ps)])
            runs[side].append(result)
            print(f"  {workload} {side:4s} {result.samples_per_sec:9.0f} samples/s  "
                  f"all roles {result.cpu_per_1000()['all']:.3f} core-s/1k", flush=True)
    sps = {side: statistics.median(r.samples_per_sec for r in rs) for side, rs in runs.items()}
    cpu = {side: median_cpu(rs) for side, rs in runs.items()}
    figures = {
        "ref_samples_per_sec": sps["ref"], "tree_samples_per_sec": sps["tree"],
        "ref_runs_samples_per_sec": [r.samples_per_sec for r in runs["ref"]],
        "tree_runs_samples_per_sec": [r.samples_per_sec for r in runs["tree"]],
        "ref_cpu_per_1000_samples": cpu["ref"], "tree_cpu_per_1000_samples": cpu["tree"],
        "throughput_ratio": sps["tree"] / sps["ref"],
        "cpu_per_sample_ratio": cpu["tree"]["all"] / cpu["ref"]["all"],
    }
    print(f"{workload}: samples/s REF {sps['ref']:.0f}  tree {sps['tree']:.0f}  ratio "
          f"{figures['throughput_ratio']:.3f}   CPU/sample ratio "
          f"{figures['cpu_per_sample_ratio']:.3f}")
    print(f"  core-s per 1,000 samples, REF : {cpu_line(cpu['ref'])}")
    print(f"  core-s per 1,000 samples, tree: {cpu_line(cpu['tree'])}")
    per_role = "  ".join(f"{r} {cpu['tree'][r] / cpu['ref'][r]:.2f}" for r in ROLES
                         if cpu["ref"][r] > 0)
    print(f"  ratio per role (tree / REF)  : {per_role}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", nargs="?",
                        help="a commit, tag or branch to compare the working tree with "
                             "(required but with --smoke, where it is HEAD)")
    parser.add_argument("--workload", default="embedding_heavy",
                        choices=["embedding_heavy", "dense_heavy", "both"])
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--num-ps", type=int, default=1,
                        help="parameter servers of the job (a batch's ids split among them)")
    parser.add_argument("--json", default=None, help="write every figure here")
    # The smoke's workload is the one ``train_throughput --smoke`` leaves out.
    args = parse_args_with_smoke(parser, argv, ref="HEAD", workload="dense_heavy", pairs=1,
                                 steps=SMOKE_WARMUP_STEPS + 3)
    if args.ref is None:
        parser.error("REF is required (a commit, tag or branch)")
    workloads = ["embedding_heavy", "dense_heavy"] if args.workload == "both" else [args.workload]
    with tempfile.TemporaryDirectory(prefix="persia-compare-") as tmp:
        ref_tree = checkout(args.ref, Path(tmp) / "ref")
        try:
            figures = {w: compare(ref_tree, w, args, Path(tmp)) for w in workloads}
        finally:
            remove(ref_tree)
    if args.json:
        first = figures[workloads[0]]
        out = {"ref": args.ref, "workloads": figures,
               "throughput_ratio": first["throughput_ratio"],
               "cpu_per_sample_ratio": first["cpu_per_sample_ratio"]}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
