"""The flags and the printout of ``persia-launcher plan`` (the model: :mod:`.plan`)."""

from __future__ import annotations

import argparse
import json
import re

import yaml

from persia_py.config import load_embedding_config, load_global_config
from persia_py.launcher.plan import (
    OPTIMIZERS,
    WEIGHT_BYTES,
    Machine,
    Workload,
    make_plan,
    tables_from_config,
)
from persia_py.launcher.plan_tier import DiskBudget, make_tier_plan
from persia_py.launcher.role_options import PlanOptions
from persia_py.servers.disk_tier import DEFAULT_FREE_FRACTION

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_bytes(text: str) -> int:
    """``256GiB``, ``12TB`` (decimal), ``1.5 TiB``, ``4096`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size like 256GiB, 12TB or 4096 (units {sorted(_UNITS)[1:]}), "
            f"got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_count(text: str) -> int:
    """``1000000``, ``1e9``, ``6.25e12`` -> a whole count >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 1000000 or 1e9, got "
                                         f"{text!r}") from None
    if not value >= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count >= 0, got {text!r}")
    return int(value)


def _slot_count(text: str) -> tuple[str, int]:
    slot, sep, count = text.partition("=")
    if not sep or not slot:
        raise argparse.ArgumentTypeError(f"expected SLOT=N, got {text!r}")
    return slot, parse_count(count)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``persia-launcher plan``."""
    p.add_argument("--embedding-config", required=True,
                   help="the job's embedding_config.yml (slots, dims, capacities, groups)")
    p.add_argument("--global-config", default=None,
                   help="the job's global_config.yml (capacity, num_hashmap_internal_shards, "
                        "embedding_fp16; default: all defaults)")
    ids = p.add_argument_group("distinct ids per slot (the whole job's, over all servers)")
    ids.add_argument("--ids", action="append", type=_slot_count, default=[], metavar="SLOT=N",
                     help="distinct ids of one slot (repeat per slot)")
    ids.add_argument("--ids-all", type=parse_count, default=None, metavar="N",
                     help="distinct ids of every slot not given otherwise")
    ids.add_argument("--ids-file", default=None, metavar="YAML",
                     help="a YAML mapping slot -> distinct ids")
    ids.add_argument("--sample", default=None, metavar="DATA",
                     help="estimate them from a data sample (CSV with a header whose columns "
                          "are named like the slots, or Criteo TSV)")
    ids.add_argument("--sample-format", choices=("csv", "criteo"), default="csv")
    ids.add_argument("--sample-delimiter", default=",", help="csv field separator")
    ids.add_argument("--sample-scale", type=float, default=1.0, metavar="K",
                     help="the training data is K times the sample (distinct ids are "
                          "extrapolated by the sample's own growth, not K-fold)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad",
                   help="embedding optimizer of slots without their own (default adagrad)")
    p.add_argument("--row-dtype", choices=sorted(WEIGHT_BYTES), default=None,
                   help="row storage type of every table (default: each slot's row_dtype "
                        "in the embedding config, else the file's, else float32)")
    p.add_argument("--machine-memory", type=parse_bytes, required=True, metavar="SIZE",
                   help="memory of one parameter-server machine, e.g. 256GiB or 12TB")
    p.add_argument("--machine-cores", type=int, default=32, help="its CPU cores (default 32)")
    p.add_argument("--usable-memory", type=float, default=0.9, metavar="FRACTION",
                   help="share of the memory a parameter server may take (default 0.9)")
    p.add_argument("--nn-workers", type=int, default=1, help="NN workers (ranks) of the job")
    p.add_argument("--nn-workers-per-node", type=int, default=1,
                   help="NN workers per machine (GPUs per node)")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per batch and rank")
    p.add_argument("--staleness", type=int, default=2, help="embedding_staleness")
    p.add_argument("--update-log-max-bytes", type=parse_bytes, default=8 << 30, metavar="SIZE",
                   help="each parameter server's --update-log-max-bytes (default 8GiB)")
    tier = p.add_argument_group("a disk tier under every table (docs/sizing.md)")
    tier.add_argument("--machine-disk", type=parse_bytes, default=None, metavar="SIZE",
                      help="disk of one parameter server for its tier's files, e.g. 8TB: "
                           "plan RAM and disk together (rows beyond RAM on disk)")
    tier.add_argument("--disk-free-fraction", type=float, default=DEFAULT_FREE_FRACTION,
                      metavar="F", help="disk_tier.free_fraction (default 0.125)")
    tier.add_argument("--samples-per-second", type=float, default=None, metavar="N",
                      help="samples/s of one NN worker: plan the disk's random reads/s")
    tier.add_argument("--ram-hit-rate", type=float, default=None, metavar="H",
                      help="share of ids asked found in RAM (default: RAM's share of the "
                           "rows, the floor)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _distinct_ids(options: PlanOptions, slots: list[str]
                  ) -> tuple[dict[str, int], dict[str, float]]:
    counts: dict[str, int] = {}
    per_sample: dict[str, float] = {}
    if options.sample:
        from persia_py.launcher.plan_sample import estimate_distinct_ids

        counts, per_sample = estimate_distinct_ids(
            options.sample, set(slots), fmt=options.sample_format, scale=options.sample_scale,
            delimiter=options.sample_delimiter)
    if options.ids_file:
        with open(options.ids_file) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--ids-file {options.ids_file}: expected a mapping slot -> count")
        counts.update({str(k): parse_count(str(v)) for k, v in data.items()})
    counts.update(dict(options.ids))
    if options.ids_all is not None:
        for slot in slots:
            counts.setdefault(slot, options.ids_all)
    return counts, per_sample


def run_plan(options: PlanOptions) -> int:
    """``persia-launcher plan``: print the plan (text, or JSON with ``--json``)."""
    embedding = load_embedding_config(options.embedding_config)
    global_config = load_global_config(options.global_config)
    try:
        counts, per_sample = _distinct_ids(options, list(embedding.slots_config))
        tables = tables_from_config(embedding, global_config, counts, options.optimizer,
                                    per_sample, row_dtype=options.row_dtype)
        machine = Machine(memory_bytes=options.machine_memory, cores=options.machine_cores,
                          usable=options.usable_memory)
        workload = Workload(
            num_nn_workers=options.nn_workers, nn_workers_per_node=options.nn_workers_per_node,
            batch_size=options.batch_size, staleness=options.staleness,
            wire_bytes=2 if global_config.common_config.embedding_fp16 else 4,
            num_internal_shards=(
                global_config.embedding_parameter_server_config.num_hashmap_internal_shards),
            update_log_max_bytes=options.update_log_max_bytes)
        plan = make_plan(tables, machine=machine, workload=workload)
        if options.machine_disk is not None:
            plan["disk_tier"] = make_tier_plan(tables, machine=machine, workload=workload,
                                               budget=DiskBudget(
                disk_bytes=options.machine_disk, free_fraction=options.disk_free_fraction,
                samples_per_second=options.samples_per_second,
                ram_hit_rate=options.ram_hit_rate))
    except ValueError as exc:
        raise SystemExit(f"persia-launcher plan: {exc}") from None
    plan["optimizer"] = options.optimizer
    plan["row_dtype"] = "/".join(sorted({t.row_dtype for t in tables}))
    print(json.dumps(plan, indent=2) if options.json else format_plan(plan))
    return 0


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,.0f} B"


_PARTS = (("weights", "weights"), ("optimizer_state", "optimizer state"),
          ("ids_and_stamps", "ids + access stamps"), ("index", "hash index"),
          ("huge_page_slack", "huge-page slack"), ("process", "process"),
          ("messages_in_flight", "messages in flight"))


def format_plan(plan: dict) -> str:
    """The plan as a person reads it."""
    memory, machine = plan["memory_per_server"], plan["machine"]
    usable = machine["memory_bytes"] * machine["usable"]
    lines = [
        f"{len(plan['tables'])} table(s), {sum(t['distinct_ids'] for t in plan['tables']):,} "
        f"distinct ids, {plan['parameters']:,} parameters; {plan['optimizer']}, "
        f"{plan['row_dtype']} rows",
        f"machines: {_size(machine['memory_bytes'])} ({machine['usable']:.0%} usable), "
        f"{machine['cores']} cores",
        "",
        f"parameter servers: {plan['parameter_servers']:,} (by memory "
        f"{plan['servers_by_memory']:,}, by CPU {plan['servers_by_cpu']:,})",
        "each server holds:",
        f"  {'rows':<22}{memory['rows']:>16,}",
        *(f"  {label:<22}{_size(memory[key]):>16}" for key, label in _PARTS),
        f"  {'total':<22}{_size(memory['total']):>16}   of {_size(usable)} usable",
        f"bytes per parameter, all servers: {plan['bytes_per_parameter']:.2f}",
    ]
    if plan["tables_evicting"]:
        lines.append(f"capacity below the ids: {plan['tables_evicting']} will evict rows "
                     f"(raise capacity in the embedding config)")
    lines += plan["notes"]
    disk = plan["disk_per_server"]
    lines += [
        "",
        f"for {plan['nn_workers']} NN worker(s): {plan['embedding_workers']} embedding "
        f"worker(s), {plan['data_loaders']} data loader(s)",
        f"disk per server: checkpoints {_size(disk['checkpoints'])} (two kept while one is "
        f"written), update log up to {_size(disk['update_log'])}; per data loader "
        f"{_size(plan['disk_per_data_loader']['handover_log'])}",
    ]
    if "disk_tier" in plan:
        lines += _format_tier(plan["disk_tier"])
    return "\n".join(lines)


def _format_tier(tier: dict) -> list[str]:
    memory = tier["memory_per_server"]
    reads = tier["random_reads_per_s_per_server"]
    return [
        "",
        f"with a disk tier: {tier['parameter_servers']:,} parameter servers (by RAM and "
        f"disk {tier['servers_by_memory_and_disk']:,}, by CPU {tier['servers_by_cpu']:,}), "
        f"{tier['ram_row_share']:.1%} of the rows in RAM",
        f"  {'rows in RAM':<22}{memory['rows']:>16,}",
        f"  {'rows on disk':<22}{memory['disk_rows']:>16,}",
        f"  {'RAM total':<22}{_size(memory['total']):>16}   (tier's index "
        f"{_size(memory['disk_tier_ram'])})",
        f"  {'disk (tier files)':<22}{_size(memory['disk_bytes']):>16}   of "
        f"{_size(tier['disk_budget_per_server'])}",
        f"  config: capacity {tier['config']['capacity']}, disk_tier.capacity_rows "
        f"{tier['config']['disk_tier']['capacity_rows']:,}",
        "  random reads per server: " + (
            f"{reads:,.0f}/s (RAM hit rate {tier['assumed_ram_hit_rate']:.1%}, one block "
            f"a miss)" if reads is not None else "give --samples-per-second"),
    ]
