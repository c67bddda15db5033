"""FSDP on the NN workers (``FSDPOption``): same training as DDP, the rate limiter's bound
holds, and dense checkpoints move between FSDP and DDP and between numbers of ranks.

Every multi-rank run is a real job: a parameter server and an embedding worker on free
ports, and the NN-worker script under ``torchrun --standalone`` (gloo, CPU)."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EXAMPLE, ROOT, RoleProcess, start_server

from persia_py import checkpoint_format as fmt
from persia_py.dense_checkpoint import read_full_model
from persia_py.distributed import DDPOption, FSDPOption
from persia_py.fsdp_limiter import floor_bytes, plan_prefetch, unit_bytes

JOB = ROOT / "tests" / "fsdp_job" / "train.py"
STEPS = 30


# -- without processes ----------------------------------------------------------------------


def test_unit_bytes_pad_dim0_to_the_world_size() -> None:
    linear = torch.nn.Linear(5, 3)  # weight [3, 5], bias [3]: rows padded to 4
    assert unit_bytes(list(linear.parameters()), 2) == (4 * 5 + 4) * 4
    assert unit_bytes(list(linear.parameters()), 1) == (3 * 5 + 3) * 4
    assert unit_bytes(list(linear.parameters()), 2, torch.bfloat16) == (4 * 5 + 4) * 2


def test_prefetch_plan_stays_within_the_bound() -> None:
    units = [10, 10, 10, 10]
    assert plan_prefetch(units, 0, 20) == [[], [], [], []]  # the floor: no prefetch
    assert plan_prefetch(units, 0, 30) == [[1], [2], [3], []]
    assert plan_prefetch(units, 0, 40) == [[1, 2], [3], [], []]
    for bound in range(20, 80, 5):
        plan = plan_prefetch(units, 0, bound)
        issued = -1
        for m, targets in enumerate(plan):  # bytes alive at each unit, as the plan runs
            issued = max([issued, m, *targets])
            assert 2 * units[m] + sum(units[m + 1:issued + 1]) <= bound
    assert floor_bytes(units, 3, reshard_after_forward=True) == 26
    assert floor_bytes(units, 3, reshard_after_forward=False) == 56


def test_a_bound_below_one_unit_is_refused_at_construction() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    need = 2 * unit_bytes(list(model[0].parameters()), 2)
    FSDPOption(max_unsharded_bytes=need).check(model, 2)
    with pytest.raises(ValueError, match="max_unsharded_bytes=.* below the"):
        FSDPOption(max_unsharded_bytes=need - 1).check(model, 2)
    with pytest.raises(ValueError, match="max_unsharded_bytes"):
        FSDPOption(max_unsharded_bytes=0)
    with pytest.raises(ValueError, match="unknown DistributedDataParallel options"):
        DDPOption(bucket_size_mb=3)
    assert DDPOption(backend="gloo", find_unused_parameters=True).options == {
        "find_unused_parameters": True}


def test_wrap_policy_by_class_and_by_function() -> None:
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()),
                                torch.nn.Linear(2, 1))
    assert FSDPOption().units(model) == [model[0], model[1]]
    assert FSDPOption(wrap_policy=(torch.nn.Linear,)).units(model) == [model[0][0], model[1]]
    assert FSDPOption(wrap_policy=lambda m: [m[1]]).units(model) == [model[1]]
    with pytest.raises(ValueError, match="wrap_policy"):
        FSDPOption(wrap_policy=lambda m: [m]).units(model)


# -- real jobs ---------------------------------------------------------------------------------


@contextmanager
def _cluster(tmp_path: Path):
    """A parameter server and an embedding worker for one job; yields the job's env."""
    root = tmp_path / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "global_config.yml"
    config.write_text((EXAMPLE / "global_config.yml").read_text()
                      + f"checkpoint_config:\n  root: {root}\n")
    embedding = ["--embedding-config", str(EXAMPLE / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *embedding,
                               "--global-config", str(config))
    try:
        ew, ew_port = start_server("embedding-worker", *embedding,
                                   "--ps-addrs", f"127.0.0.1:{ps_port}")
        try:
            yield {"PERSIA_PS_ADDRS": f"127.0.0.1:{ps_port}",
                   "PERSIA_EMBEDDING_WORKER_ADDRS": f"127.0.0.1:{ew_port}",
                   "PERSIA_GLOBAL_CONFIG": str(config),
                   "PERSIA_EMBEDDING_CONFIG": str(EXAMPLE / "embedding_config.yml")}, root
        finally:
            ew.stop()
    finally:
        ps.stop()


def _job(env: dict, out: Path, nproc: int, *args: str) -> list[dict]:
    """Run the NN-worker script on ``nproc`` ranks; returns each rank's stats."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    job = RoleProcess([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={nproc}", str(JOB), "--out", str(out), *args],
                      env={**os.environ, **env})
    try:
        code = job.wait(timeout=300)
    finally:
        job.stop()
    assert code == 0, job.output()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _ps_rows(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table's (ids, weights) in a checkpoint, sorted by id."""
    rows = {}
    manifest = fmt.load_json(folder / fmt.MANIFEST)
    for r in range(manifest["num_ps_replicas"]):
        for name, table in fmt.load_json(folder / f"ps-{r}.json")["tables"].items():
            ids = fmt.load_array(folder / table["files"]["ids"])
            order = np.argsort(ids)
            rows[f"{name}.{r}"] = (ids[order],
                                   fmt.load_array(folder / table["files"]["weights"])[order])
    return rows


@pytest.mark.processes
def test_fsdp_trains_as_ddp_within_a_bound_of_two_units(tmp_path) -> None:
    """(a) same losses and embedding rows as DDP; (b) with max_unsharded_bytes = two of
    the largest unit, the measured peak never exceeds it and training completes."""
    runs = {}
    for name, args in (("ddp", ["--dist", "ddp"]),
                       ("fsdp", ["--dist", "fsdp", "--bound-units", "2"])):
        with _cluster(tmp_path / name) as (env, root):
            stats = _job(env, tmp_path / name / "out", 2, *args, "--steps", str(STEPS),
                         "--dump", str(root / "final"))
            runs[name] = (stats, fmt.resolve(root / "final"))
    (ddp, ddp_ckpt), (fsdp, fsdp_ckpt) = runs["ddp"], runs["fsdp"]
    for rank in range(2):
        assert ddp[rank]["steps"] == fsdp[rank]["steps"] == STEPS
        a, b = np.array(ddp[rank]["losses"]), np.array(fsdp[rank]["losses"])
        assert np.max(np.abs(a - b) / np.abs(a)) <= 1e-4, (a, b)
    ddp_rows, fsdp_rows = _ps_rows(ddp_ckpt), _ps_rows(fsdp_ckpt)
    assert ddp_rows.keys() == fsdp_rows.keys()
    for key, (ids, weights) in ddp_rows.items():
        assert np.array_equal(ids, fsdp_rows[key][0]), key
        np.testing.assert_allclose(fsdp_rows[key][1], weights, rtol=1e-4, atol=1e-6)
    for rank in range(2):
        bound = fsdp[rank]["bound"]
        assert bound is not None and 0 < fsdp[rank]["peak"] <= bound, fsdp[rank]
    # The dense towers agree too, gathered from the shards.
    ddp_dense, fsdp_dense = read_full_model(ddp_ckpt), read_full_model(fsdp_ckpt)
    assert ddp_dense.keys() == fsdp_dense.keys()
    for key, value in ddp_dense.items():
        np.testing.assert_allclose(fsdp_dense[key].numpy(), value.numpy(), rtol=1e-4,
                                   atol=1e-6)


@pytest.mark.processes
def test_checkpoint_round_trip_fsdp2_ddp1_fsdp2(tmp_path) -> None:
    with _cluster(tmp_path) as (env, root):
        _job(env, tmp_path / "a", 2, "--dist", "fsdp", "--steps", "4",
             "--dump", str(root / "a"))
        _job(env, tmp_path / "b", 1, "--dist", "ddp", "--steps", "0",
             "--load", str(root / "a"), "--dump", str(root / "b"))
        _job(env, tmp_path / "c", 2, "--dist", "fsdp", "--steps", "0",
             "--load", str(root / "b"), "--dump", str(root / "c"))
        a, b, c = (fmt.resolve(root / n) for n in "abc")
    assert (a / "dense-dcp.json").is_file() and (c / "dense-dcp.json").is_file()
    assert (b / "dense-model.json").is_file()  # the DDP job wrote the whole model
    weights = [read_full_model(f) for f in (a, b, c)]
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
        assert torch.equal(weights[0][key], weights[2][key]), key
    # The optimizer state made the trip too (Adagrad's sums, by parameter name).
    sums_b = fmt.read_optimizer(b, "dense-optimizer")["state"]
    assert any(float(s["sum"].abs().sum()) > 0 for s in sums_b.values())
