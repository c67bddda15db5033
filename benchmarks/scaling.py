"""How a job's cost grows with it: samples/s, core-seconds per 1,000 samples of every role
and the NN worker's p50/p99 step time, as the parameter servers, embedding workers, table,
batch and ids per sample grow, one factor at a time from a base point.

    python -m benchmarks.scaling [--factors F,...] [--no-shared-memory] [--json PATH]
                                 [--plot PATH.png] [--smoke]

The job is ``benchmarks.train_throughput``'s embedding-heavy one (``persia-launcher local``,
one NN worker and one data loader, 26 slots of dim 32, Zipf ids, Adagrad, staleness 4,
float16 wire), measured as that benchmark measures it (``benchmarks.role_cpu``: each role's
CPU from /proc over the timed window only). The base point is 1 parameter server, 1
embedding worker, a 1M-row table, batch 1,024 and 20 ids per slot (520 per sample); each
other point changes one factor of it (:data:`FACTORS`), so the grid is 12 jobs, not the
288 of the full cross product.

* table rows: the id range of the stream, all slots together (each slot draws from
  rows / 26 ids). The parameter servers grow their tables as ids arrive, so a table holds
  what the stream brought: ``table_rows_held`` is the distinct ids of the run's batches
  (the data loader counts them), the rows held at the end.
* steps: every point trains on about the same number of ids (:data:`TIMED_IDS`, at least
  :data:`MIN_STEPS` and at most :data:`MAX_STEPS` batches after a warm-up of about
  :data:`WARMUP_IDS` ids), so that small batches are not timed over a few milliseconds and
  large ones fit in memory (the data loader builds its batches before sending). Before the
  first job every point's worst case (every id distinct, else the distinct ids the stream
  holds; a growing table's copy; the batches: :func:`memory_needed`) is checked against
  the memory available now.
* step time: the NN worker's wall time from taking one batch to taking the next.
* load: the machine's 1-minute load average before and after each job
  (``load_average``): other people's processes on the same cores show there.
* network: each job runs in a network namespace of its own (``unshare --net``, where it
  can: as root), and ``network_bytes_per_sample`` is what its processes sent
  each other over loopback inside the window, TCP/IP headers included: the parameter
  servers' and embedding workers' messages and the data loader's batches. Roles on one
  host pass lookup answers and gradients through shared memory (``common_config
  .shared_memory``), so those arrays are not in it; ``--no-shared-memory`` puts them in the
  messages, as between roles on different hosts: its figure is what would cross the
  network if every role had a host of its own.

Every process of a job shares this machine's cores: where the job has more processes than
the machine has cores, the figures show what more processes cost, not what more machines
would give (docs/benchmarks.md#scaling says what they project).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks import parse_args_with_smoke
from benchmarks.role_cpu import ROLES, own_network_unavailable
from benchmarks.train_throughput import SLOT_NAMES, WORKLOADS, ours
from persia_py.servers import sizing

WORKLOAD = "embedding_heavy"
NUM_SLOTS = len(SLOT_NAMES)


@dataclass(frozen=True)
class Point:
    """One job of the grid."""

    num_ps: int = 1
    num_embedding_workers: int = 1
    table_rows: int = 1_000_000
    batch_size: int = 1024
    ids_per_slot: int = 20

    @property
    def ids_per_batch(self) -> int:
        return self.batch_size * self.ids_per_slot * NUM_SLOTS


BASE = Point()
FACTORS: dict[str, list[int]] = {
    "num_ps": [1, 2, 4],
    "num_embedding_workers": [1, 2],
    "table_rows": [1_000_000, 10_000_000, 100_000_000],
    "batch_size": [256, 1024, 4096, 8192],
    "ids_per_slot": [1, 5, 20, 100],
}
"""Each factor's values; the others stay at :data:`BASE`'s."""
SMOKE_BASE = Point(table_rows=26_000, batch_size=32, ids_per_slot=2)
SMOKE_FACTORS = {"num_ps": [1, 2]}
TIMED_IDS = 20_000_000
WARMUP_IDS = 5_000_000
MIN_STEPS, MAX_STEPS = 10, 200
MIN_WARMUP, MAX_WARMUP = 3, 20
SMOKE_STEPS, SMOKE_WARMUP = 3, 1
MAX_MESSAGE_BYTES = 1 << 30
"""``common_config.max_message_bytes`` of every job: an embedding worker refuses a batch
whose lookup answer (its distinct rows, an index per id) would pass it, and the default
512 MiB refuses batch 8,192 at 520 ids per sample from a wide id range, where nearly every
id is distinct (580 MB)."""


def grid(base: Point, factors: dict[str, list[int]]) -> list[tuple[str, Point]]:
    """The base point (named ``base``) and, per factor, the points that change it alone."""
    points = [("base", base)]
    for factor, values in factors.items():
        points += [(factor, replace(base, **{factor: v})) for v in values
                   if v != getattr(base, factor)]
    return points


def steps_of(point: Point, smoke: bool) -> tuple[int, int]:
    """(warm-up steps, timed steps) of ``point``."""
    if smoke:
        return SMOKE_WARMUP, SMOKE_STEPS
    warmup = min(MAX_WARMUP, max(MIN_WARMUP, WARMUP_IDS // point.ids_per_batch))
    return warmup, min(MAX_STEPS, max(MIN_STEPS, TIMED_IDS // point.ids_per_batch))


def stream_rows(point: Point, num_steps: int) -> int:
    """The distinct ids per slot, summed, of the batches ``point``'s data loader sends
    (the same ones: ``Workload.batch`` is seeded by the step)."""
    w = replace(WORKLOADS[WORKLOAD], batch_size=point.batch_size,
                ids_per_slot=point.ids_per_slot, vocab=point.table_rows // NUM_SLOTS)
    slots: list[list[np.ndarray]] = [[] for _ in range(NUM_SLOTS)]
    for step in range(num_steps):
        for slot, ids in zip(slots, w.batch(step)[1]):
            slot.append(ids)
    return sum(np.unique(np.concatenate(slot)).size for slot in slots)


def memory_needed(point: Point, num_steps: int, rows: int | None = None) -> int:
    """Bytes the job could take beyond its processes: the parameter servers' ``rows``
    (default: as many as the stream's ids, at most the id range), twice while a table
    grows, and the data loader's batches, built before it sends."""
    num_ids = point.ids_per_batch * num_steps
    if rows is None:
        rows = min(point.table_rows, num_ids)
    dim = WORKLOADS[WORKLOAD].dim
    return 2 * rows * sizing.row_bytes(dim, dim) + num_ids * np.dtype(np.uint64).itemsize


def memory_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes: what this machine can give without
    swapping (other people's jobs share it)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise LookupError("no MemAvailable in /proc/meminfo")


def check_memory(point: Point, smoke: bool) -> tuple[int, int]:
    """(bytes ``point``'s job could take, bytes available); MemoryError if more."""
    num_steps = sum(steps_of(point, smoke))
    needed, available = memory_needed(point, num_steps), memory_available()
    if needed > available:  # every id distinct would not fit: count the stream's
        rows = stream_rows(point, num_steps)
        needed = memory_needed(point, num_steps, rows)
        if needed > available:
            raise MemoryError(
                f"{point}: its tables ({rows:,} rows) and batches could take "
                f"{needed / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB this "
                "machine has available now; leave that factor out (--factors) or run it "
                "where there is more")
    return needed, available


def measure(point: Point, workdir: Path, *, smoke: bool, own_network: bool,
            shared_memory: bool = True) -> dict:
    """Run ``point``'s job once; its figures."""
    warmup, timed = steps_of(point, smoke)
    if point.table_rows < NUM_SLOTS:
        raise ValueError(f"table_rows {point.table_rows}: at least one row per slot "
                         f"({NUM_SLOTS}) is needed")
    needed, available = check_memory(point, smoke)
    sizes = (f"--batch-size {point.batch_size} --ids-per-slot {point.ids_per_slot} "
             f"--vocab {point.table_rows // NUM_SLOTS}")
    load_before = os.getloadavg()[0]
    result = ours(WORKLOAD, warmup + timed, 4, workdir, smoke=smoke,
                  launcher_args=["--num-ps", str(point.num_ps), "--num-embedding-workers",
                                 str(point.num_embedding_workers), "--no-metrics"],
                  script_args=sizes, nn_args=f"--warmup {warmup}", loader_args="--count-rows",
                  own_network=own_network, max_message_bytes=MAX_MESSAGE_BYTES,
                  shared_memory=shared_memory)
    load = (load_before, os.getloadavg()[0])
    cpu = result.cpu_per_1000()
    ids_per_1000 = 1000 * point.ids_per_slot * NUM_SLOTS

    def per_core_s(role: str, per_1000: float) -> float | None:
        return per_1000 / cpu[role] if cpu[role] > 0 else None

    return {
        **asdict(point), "warmup_steps": warmup, "timed_steps": timed,
        "memory_needed_bytes": needed, "memory_available_bytes": available,
        "load_average": load,
        "samples_per_sec": result.samples_per_sec, "samples": result.samples,
        "cpu_per_1000_samples": cpu,
        "step_ms_p50": result.figures["step_ms_p50"],
        "step_ms_p99": result.figures["step_ms_p99"],
        "table_rows_held": int(result.figures["table_rows"]),
        "network_bytes_per_sample": (None if result.network_bytes is None
                                     else result.network_bytes / result.samples),
        # what one core of each role serves: the projections' rates
        "ps_ids_per_core_s": per_core_s("parameter_server", ids_per_1000),
        "embedding_worker_samples_per_core_s": per_core_s("embedding_worker", 1000),
        "nn_worker_samples_per_core_s": per_core_s("nn_worker", 1000),
        "samples_per_core_s": 1000 / cpu["all"],
    }


def table(points: list[dict]) -> str:
    """The grid as a Markdown table."""
    head = ("| varied | PS | EW | table rows (held) | batch | ids/slot | samples/s | "
            "core-s/1k: PS | EW | loader | NN | launcher | all | step ms p50 / p99 | "
            "net B/sample |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        c = p["cpu_per_1000_samples"]
        net = p["network_bytes_per_sample"]
        lines.append(
            f"| {p['varied']} | {p['num_ps']} | {p['num_embedding_workers']} | "
            f"{p['table_rows']:,} ({p['table_rows_held']:,}) | {p['batch_size']:,} | "
            f"{p['ids_per_slot']} | {p['samples_per_sec']:,.0f} | "
            + " | ".join(f"{c[r]:.3f}" for r in (*ROLES, "all"))
            + f" | {p['step_ms_p50']:.0f} / {p['step_ms_p99']:.0f} | "
            f"{'-' if net is None else f'{net:,.0f}'} |")
    return "\n".join(lines)


LABELS = {"num_ps": "parameter servers", "num_embedding_workers": "embedding workers",
          "table_rows": "table rows (id range)", "batch_size": "batch size",
          "ids_per_slot": "ids per slot (26 slots)"}


def plot(figures: dict, path: str) -> None:
    """One column per factor: samples/s, each role's CPU per sample, p50/p99 step time and
    loopback bytes per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    factors = list(figures["factors"])
    fig, axes = plt.subplots(4, len(factors), squeeze=False,
                             figsize=(3.2 * len(factors), 9.5))
    for column, factor in enumerate(factors):
        points = sorted((p for p in figures["points"] if p["varied"] in ("base", factor)),
                        key=lambda p: p[factor])
        x = [p[factor] for p in points]
        rate, cpu, step, net = (axes[row][column] for row in range(4))
        rate.plot(x, [p["samples_per_sec"] for p in points], marker="o")
        for role in (*ROLES, "all"):
            values = [p["cpu_per_1000_samples"][role] for p in points]
            if max(values) > 0:
                cpu.plot(x, values, marker=".", label=role.replace("_", " "),
                         linewidth=2.5 if role == "all" else 1)
        step.plot(x, [p["step_ms_p50"] for p in points], marker="o", color="C0", label="p50")
        step.plot(x, [p["step_ms_p99"] for p in points], marker="o", color="C0",
                  linestyle="--", label="p99")
        if all(p["network_bytes_per_sample"] is not None for p in points):
            net.plot(x, [p["network_bytes_per_sample"] / 1000 for p in points], marker="o")
        for ax in (rate, cpu, step, net):
            ax.set_xscale("log" if max(x) / min(x) > 8 else "linear")
            ax.set_xticks(x, [f"{v:,}" if v < 1_000_000 else f"{v // 1_000_000}M" for v in x])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        net.set_xlabel(LABELS.get(factor, factor))
    for ax, label in zip(axes[:, 0], ("samples/s", "core-s per 1,000 samples",
                                      "step ms (p50, p99)", "loopback kB per sample")):
        ax.set_ylabel(label)
    axes[1][0].legend(fontsize=7)
    axes[2][0].legend(fontsize=7)
    fig.suptitle(figures["title"], fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", default=",".join(FACTORS),
                        help="comma-separated, of " + ", ".join(FACTORS))
    parser.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                        help="arrays in the messages, as between roles on different hosts "
                             "(common_config.shared_memory: false)")
    parser.add_argument("--json", default=None, help="write the grid here")
    parser.add_argument("--plot", default=None, help="draw the grid into this PNG (matplotlib)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="run nothing: print and draw (--plot) the grid an earlier run wrote")
    args = parse_args_with_smoke(parser, argv, factors=",".join(SMOKE_FACTORS))
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        print(table(result["points"]))
        if args.plot:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
        return
    names = [f for f in args.factors.split(",") if f]
    if not names or set(names) - set(FACTORS):
        parser.error(f"--factors takes {', '.join(FACTORS)}, got {args.factors!r}")
    base = SMOKE_BASE if args.smoke else BASE
    factors = {f: SMOKE_FACTORS.get(f, FACTORS[f]) if args.smoke else FACTORS[f] for f in names}
    unavailable = own_network_unavailable()
    if unavailable:
        print(f"network bytes not measured: {unavailable}", flush=True)
    jobs = grid(base, factors)
    for _, point in jobs:  # before the first job, not at the last
        check_memory(point, args.smoke)
    points = []
    with tempfile.TemporaryDirectory(prefix="persia-scaling-") as tmp:
        for varied, point in jobs:
            figures = measure(point, Path(tmp), smoke=args.smoke,
                              own_network=unavailable is None,
                              shared_memory=args.shared_memory)
            points.append({"varied": varied, **figures})
            print(f"{varied:22s} {point}: {figures['samples_per_sec']:9.0f} samples/s  "
                  f"all roles {figures['cpu_per_1000_samples']['all']:.3f} core-s/1k  "
                  f"step p50/p99 {figures['step_ms_p50']:.0f}/{figures['step_ms_p99']:.0f} ms",
                  flush=True)
    result = {
        "title": f"benchmarks.scaling: {WORKLOAD}, one factor at a time from "
                 f"{', '.join(f'{k}={v:,}' for k, v in asdict(base).items())} "
                 f"({os.cpu_count()} cores"
                 f"{'' if args.shared_memory else ', no shared memory'})",
        "workload": WORKLOAD, "base": asdict(base), "factors": factors,
        "cpu_count": os.cpu_count(), "network_unavailable": unavailable,
        "shared_memory": args.shared_memory, "points": points}
    print(table(points))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
