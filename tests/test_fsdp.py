"""FSDP on the NN workers (``FSDPOption``): same training as DDP, the rate limiter's bound
holds, a tower built on the meta device starts from the weights of the ordinary build,
dense checkpoints move between FSDP and DDP and between numbers of ranks, ranks with
different numbers of batches (or none) train every batch once and skip (not stall on)
periodic checkpoints after one ran out, mixed precision trains as under DDP, a NaN loss
skips the dense step on every rank, ``with_jit_model`` scripts the gathered tower, and
embedding staleness with a small byte budget trains under a bound set in the config.

The multi-rank checks read one real job: a parameter server and an embedding worker on
free ports, and the NN-worker script ``tests/fsdp_job/train.py`` under ``torchrun
--standalone`` (gloo, CPU), which runs every phase in turn on one process group (each
phase that needs the servers' rows as they were at the start loads the ``init``
checkpoint). One launch instead of one per phase: process start-up, not training, is
most of the time of such a job on two cores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkout import EXAMPLE, ROOT
from child_processes import RoleProcess, start_server

from persia_py.checkpoint import layout as fmt
from persia_py.checkpoint.dense import read_full_model
from persia_py.dense.fsdp_limiter import floor_bytes, plan_prefetch, unit_bytes
from persia_py.distributed import DDPOption, FSDPOption, build_on_meta, materialize
from persia_py.ops import safe_files
from persia_py.serving import load_dense_model

JOB = ROOT / "tests" / "fsdp_job" / "train.py"
STEPS = 30
UNEVEN = (3, 6)  # batches of rank 0 and rank 1 in the uneven phases
PERIOD = 2  # periodic checkpoint every this many steps there
EMPTY = (0, 3)  # batches of rank 0 and rank 1 in the empty phases
AMP_STEPS = 10
NAN_STEPS, NAN_AT = 5, 3  # rank 0's loss is NaN at step NAN_AT (from 1)
STALE_STEPS, STALE_BUDGET = 8, 256 << 10  # staleness 2, room for one batch (~170 KB)


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


def test_the_config_bound_applies_when_the_option_sets_none() -> None:
    """``nn_worker_config.fsdp_max_unsharded_bytes`` bounds an ``FSDPOption()`` (checked
    against the tower when ``TrainCtx`` is made, the message naming the key); the
    option's own bound wins; the caller's option is not changed."""
    from persia_py.config import global_config_from_dict
    from persia_py.ctx import TrainCtx
    from persia_py.embedding.optim import SGD
    from persia_py.env import PersiaEnv

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    need = 2 * unit_bytes(list(model[0].parameters()), 2)

    def bound(option, config_bound):
        config = global_config_from_dict(
            {"nn_worker_config": {"fsdp_max_unsharded_bytes": config_bound}})
        ctx = TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                       dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       distributed_option=option, global_config=config,
                       env=PersiaEnv(world_size=2))
        return getattr(ctx.distributed_option, "max_unsharded_bytes", None)

    option = FSDPOption()
    assert bound(option, need) == need and option.max_unsharded_bytes is None
    assert bound(option, None) is None
    assert bound(FSDPOption(max_unsharded_bytes=need + 1), need) == need + 1
    assert bound(FSDPOption(max_unsharded_bytes=need), need - 1) == need
    with pytest.raises(ValueError, match=r"nn_worker_config\.fsdp_max_unsharded_bytes="
                                         f"{need - 1} is below the {need} bytes"):
        bound(FSDPOption(), need - 1)
    assert bound(DDPOption(), need - 1) is None  # whole replicas: nothing to bound


def test_wrap_policy_by_class_and_by_function() -> None:
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()),
                                torch.nn.Linear(2, 1))
    assert FSDPOption().units(model) == [model[0], model[1]]
    assert FSDPOption(wrap_policy=(torch.nn.Linear,)).units(model) == [model[0][0], model[1]]
    assert FSDPOption(wrap_policy=lambda m: [m[1]]).units(model) == [model[1]]
    with pytest.raises(ValueError, match="wrap_policy"):
        FSDPOption(wrap_policy=lambda m: [m]).units(model)


def test_settling_waits_for_the_group_then_leaves_the_gil_only_under_gloo(monkeypatch) -> None:
    """``settle_finished_collectives`` (``TrainCtx``'s exit, before the group goes):
    a barrier then a pause with a gloo group of several ranks; nothing otherwise (one
    rank, no group, NCCL). Whether a rank then exits cleanly is a race (see
    docs/benchmarks.md#test-suite), not checked here."""
    import torch.distributed as dist

    from persia_py.dense import process_group

    calls: list[object] = []
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(process_group.time, "sleep", calls.append)

    def settle(initialized: bool, world: int, backend: str, barrier: bool = True
               ) -> list[object]:
        calls.clear()
        monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
        monkeypatch.setattr(dist, "get_world_size", lambda: world)
        monkeypatch.setattr(dist, "get_backend", lambda: backend)
        process_group.settle_finished_collectives(barrier=barrier)
        return list(calls)

    assert settle(True, 2, "gloo") == ["barrier", process_group.SETTLE_SEC]
    # DDP's ranks may leave at different times: a pause, no barrier to wait in.
    assert settle(True, 2, "gloo", barrier=False) == [process_group.SETTLE_SEC]
    assert settle(False, 2, "gloo") == []
    assert settle(True, 1, "gloo") == []
    assert settle(True, 2, "nccl") == []


def _criteo_model():
    sys.path.insert(0, str(EXAMPLE))
    from model import DLRM

    return DLRM


def test_build_on_meta_takes_no_memory_and_materializes_as_the_cpu_build() -> None:
    """The values (and the buffers computed in the constructor) equal the ordinary
    build's, the caller's RNG is untouched, and the optimizer is pointed at the new
    parameters with its eagerly made state (Adagrad's sums) made again."""
    dlrm = _criteo_model()
    torch.manual_seed(3)
    reference = dlrm()
    torch.manual_seed(3)
    model = build_on_meta(dlrm)
    assert all(p.is_meta for p in model.parameters())
    assert not model.pair_rows.is_meta  # buffers are built as usual
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    torch.manual_seed(9)
    materialize(model, optimizer, torch.device("cpu"))
    assert torch.equal(torch.rand(4), torch.manual_seed(9) and torch.rand(4))
    expected, got = reference.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    params = list(model.parameters())
    assert optimizer.param_groups[0]["params"] == params
    assert all(torch.equal(optimizer.state[p]["sum"], torch.full_like(p, 0.5)) for p in params)


def test_build_on_meta_refuses_what_it_could_not_replay() -> None:
    class NoReset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

    class RandomBuffer(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.register_buffer("noise", torch.randn(2))

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.b.weight = self.a.weight

    with pytest.raises(ValueError, match="no reset_parameters"):
        build_on_meta(NoReset)
    with pytest.raises(ValueError, match="drew random numbers"):
        build_on_meta(RandomBuffer)
    with pytest.raises(ValueError, match="shared between"):
        build_on_meta(Tied)


# -- one real job: every phase (see tests/fsdp_job/train.py) ---------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict, Path]:
    """The stats of every phase (``"<phase>": [rank 0's, rank 1's]``) and the
    checkpoint root, after one launch of the job script on 2 ranks."""
    import os

    tmp = tmp_path_factory.mktemp("fsdp")
    root, out = tmp / "checkpoints", tmp / "out"
    root.mkdir()
    out.mkdir()
    config = tmp / "global_config.yml"
    config.write_text((EXAMPLE / "global_config.yml").read_text()
                      + f"checkpoint_config:\n  root: {root}\n")
    embedding = ["--embedding-config", str(EXAMPLE / "embedding_config.yml")]
    ps, ps_port = start_server("embedding-parameter-server", *embedding,
                               "--global-config", str(config))
    try:
        ew, ew_port = start_server("embedding-worker", *embedding,
                                   "--ps-addrs", f"127.0.0.1:{ps_port}")
        try:
            env = {**os.environ,
                   "PERSIA_PS_ADDRS": f"127.0.0.1:{ps_port}",
                   "PERSIA_EMBEDDING_WORKER_ADDRS": f"127.0.0.1:{ew_port}",
                   "PERSIA_GLOBAL_CONFIG": str(config),
                   "PERSIA_EMBEDDING_CONFIG": str(EXAMPLE / "embedding_config.yml")}
            launch = RoleProcess([sys.executable, "-m", "torch.distributed.run",
                                  "--standalone", "--nproc-per-node=2", str(JOB),
                                  "--root", str(root), "--out", str(out)], env=env)
            try:
                code = launch.wait(timeout=600)
            finally:
                launch.stop()
            assert code == 0, launch.output()
        finally:
            ew.stop()
    finally:
        ps.stop()
    stats = {}
    for path in out.glob("*-rank*.json"):
        phase, rank = path.stem.rsplit("-rank", 1)
        stats.setdefault(phase, [None, None])[int(rank)] = json.loads(path.read_text())
    return stats, root


def _ps_rows(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table's (ids, weights) in a checkpoint, sorted by id."""
    rows = {}
    manifest = safe_files.load_json(folder / fmt.MANIFEST)
    for r in range(manifest["num_ps_replicas"]):
        for name, table in safe_files.load_json(folder / f"ps-{r}.json")["tables"].items():
            ids = safe_files.load_array(folder / table["files"]["ids"])
            order = np.argsort(ids)
            rows[f"{name}.{r}"] = (ids[order],
                                   safe_files.load_array(folder / table["files"]["weights"])[order])
    return rows


def _same_training(a: Path, b: Path) -> None:
    """The same embedding rows and the same dense tower, within float tolerance."""
    rows_a, rows_b = _ps_rows(a), _ps_rows(b)
    assert rows_a.keys() == rows_b.keys() and rows_a
    for key, (ids, weights) in rows_a.items():
        assert np.array_equal(ids, rows_b[key][0]), key
        np.testing.assert_allclose(rows_b[key][1], weights, rtol=1e-4, atol=1e-6)
    dense_a, dense_b = read_full_model(a), read_full_model(b)
    assert dense_a.keys() == dense_b.keys()
    for key, value in dense_a.items():
        np.testing.assert_allclose(dense_b[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.processes
def test_fsdp_trains_as_ddp_within_a_bound_of_two_units(job) -> None:
    """(a) same losses (reproducible mode) and embedding rows as DDP; (b) with
    max_unsharded_bytes = two of the largest unit, the limiter prefetches within it
    (the Criteo tower's bottom unit is small enough for the top's all-gather to be
    issued during its forward), the measured peak never exceeds it and training
    completes."""
    stats, root = job
    ddp, fsdp = stats["ddp"], stats["fsdp"]
    for rank in range(2):
        assert ddp[rank]["steps"] == fsdp[rank]["steps"] == STEPS
        a, b = np.array(ddp[rank]["losses"]), np.array(fsdp[rank]["losses"])
        assert np.max(np.abs(a - b) / np.abs(a)) <= 1e-4, (a, b)
        bound = fsdp[rank]["bound"]
        assert bound is not None and 0 < fsdp[rank]["peak"] <= bound, fsdp[rank]
        assert any(fsdp[rank]["plan_forward"]), fsdp[rank]["plan_forward"]
    # The rows on the servers and the dense towers (gathered from the shards) agree too.
    _same_training(fmt.resolve(root / "ddp"), fmt.resolve(root / "fsdp"))


@pytest.mark.processes
def test_a_tower_built_on_meta_is_sharded_with_the_weights_of_the_cpu_build(job) -> None:
    """The FSDP phase built its tower with build_on_meta (initialized unit by unit, each
    sharded before the next): gathered, it equals the DDP phase's ordinary build."""
    for rank in range(2):
        assert job[0]["fsdp"][rank]["meta_build_differs"] == []
        assert len(job[0]["fsdp"][rank]["meta_build_keys"]) == 10  # 5 Linear layers


def _dlrm() -> torch.nn.Module:
    sys.path.insert(0, str(EXAMPLE))
    from model import DLRM
    return DLRM()


@pytest.mark.processes
def test_checkpoint_round_trip_fsdp2_ddp1_fsdp2(job) -> None:
    _, root = job
    a, b, c = (fmt.resolve(root / n) for n in ("fsdp", "b", "c"))
    assert (a / "dense-dcp.json").is_file() and (c / "dense-dcp.json").is_file()
    assert (b / "dense-model.json").is_file()  # the 1-rank DDP job wrote the whole model
    assert safe_files.load_json(b / fmt.MANIFEST)["world_size"] == 1
    weights = [read_full_model(f) for f in (a, b, c)]
    assert weights[0].keys() == weights[1].keys() == weights[2].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
        assert torch.equal(weights[0][key], weights[2][key]), key
    # Serving (persia-launcher serve --checkpoint) loads the FSDP checkpoint's whole tower.
    served = load_dense_model(_dlrm, a).state_dict()
    assert served.keys() == weights[0].keys()
    assert all(torch.equal(served[k], weights[0][k]) for k in served)
    # The optimizer state made the trip too (Adagrad's sums, by parameter name).
    sums_b = fmt.read_optimizer(b, "dense-optimizer")["state"]
    assert any(float(s["sum"].abs().sum()) > 0 for s in sums_b.values())


@pytest.mark.processes
def test_uneven_batches_train_each_once_and_skip_periodic_checkpoints(job) -> None:
    """Rank 0 has 3 batches, rank 1 has 6. Under FSDP rank 0 replays its last batch with
    zero loss for rank 1's steps 4-6 (Join): every batch is trained once, as DDP's Join
    trains them (same rows on the servers, same dense tower); the periodic checkpoint
    of step 2 is written, those of steps 4 and 6 (rank 0 out of batches) are skipped,
    and the job ends."""
    stats, root = job
    for phase in ("uneven-ddp", "uneven-fsdp"):
        for rank in range(2):
            assert stats[phase][rank]["steps"] == stats[phase][rank]["trained"] == UNEVEN[rank]
    _same_training(fmt.resolve(root / "uneven-ddp"), fmt.resolve(root / "uneven-fsdp"))
    periodic = [p for p in (root / "periodic").iterdir() if p.name.startswith("ckpt-")]
    assert len(periodic) == 1, periodic
    manifest = safe_files.load_json(periodic[0] / fmt.MANIFEST)
    assert manifest["rank_steps"] == [PERIOD, PERIOD]
    assert fmt.resolve(root / "periodic") == periodic[0]


@pytest.mark.processes
def test_a_rank_with_no_batch_joins_and_trains_as_with_ddp(job) -> None:
    """Rank 0 gets no batch at all: under FSDP it takes rank 1's inputs at the first step
    and shadows its 3 steps (instead of waiting out the collective timeout); the result
    is that of DDP's Join (same rows on the servers, same dense tower)."""
    stats, root = job
    for phase in ("empty-ddp", "empty-fsdp"):
        for rank in range(2):
            assert stats[phase][rank]["steps"] == stats[phase][rank]["trained"] == EMPTY[rank]
    _same_training(fmt.resolve(root / "empty-ddp"), fmt.resolve(root / "empty-fsdp"))


@pytest.mark.processes
def test_mixed_precision_trains_under_fsdp_as_under_ddp(job) -> None:
    """``mixed_precision=True`` (bfloat16 autocast on the CPU): FSDP's losses follow DDP's
    under the same autocast, and differ from the float32 run's (autocast was on)."""
    stats, _ = job
    for rank in range(2):
        ddp = np.array(stats["amp-ddp"][rank]["losses"])
        fsdp = np.array(stats["amp-fsdp"][rank]["losses"])
        fp32 = np.array(stats["ddp"][rank]["losses"][:AMP_STEPS])
        assert len(ddp) == len(fsdp) == AMP_STEPS
        assert np.isfinite(fsdp).all()
        assert np.max(np.abs(ddp - fsdp) / np.abs(ddp)) <= 1e-4, (ddp, fsdp)
        assert not np.allclose(ddp, fp32, rtol=1e-6, atol=0), (ddp, fp32)


@pytest.mark.processes
def test_a_nan_loss_skips_the_dense_step_on_every_rank(job) -> None:
    """Rank 0's loss is NaN at one step: on both ranks the dense step is skipped (the
    gathered weights are unchanged across it, one skip counted), training goes on with
    finite losses, and the job ends as the DDP job with the same NaN does (rank 0's
    embedding gradients of that step are skipped by the embedding worker, rank 1's are
    applied). Under FSDP the ranks agree on skipping even when the NaN lies in rank 0's
    shard only."""
    stats, root = job
    for phase in ("nan-ddp", "nan-fsdp"):
        for rank in range(2):
            s = stats[phase][rank]
            assert s["steps"] == NAN_STEPS and s["skipped"] == 1, s
            assert s["keys"] and s["unchanged"] == s["keys"]
            losses = np.array(s["losses"])
            assert np.isnan(losses[NAN_AT - 1]) == (rank == 0)
            assert np.isfinite(np.delete(losses, NAN_AT - 1)).all()
    assert [s["partial_nan_finite"] for s in stats["nan-fsdp"]] == [False, False]
    _same_training(fmt.resolve(root / "nan-ddp"), fmt.resolve(root / "nan-fsdp"))


@pytest.mark.processes
def test_with_jit_model_under_fsdp_scripts_the_gathered_tower(job) -> None:
    """The FSDP checkpoint holds the whole tower as TorchScript, computing what the
    gathered weights compute; an unscriptable tower is refused on every rank with
    TorchScript's reason, before anything is written."""
    stats, root = job
    folder = fmt.resolve(root / "fsdp")
    scripted = torch.jit.load(str(folder / "jit_dense.pt"))
    whole = load_dense_model(_dlrm, folder)
    dense, embeddings = [torch.randn(5, 13)], [torch.randn(5, 16) for _ in range(26)]
    assert torch.allclose(scripted(dense, embeddings), whole(dense, embeddings), atol=1e-6)
    weights = scripted.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in whole.state_dict().items())
    for rank in range(2):
        refused = stats["fsdp-load"][rank]["jit_refused"]
        assert refused and "torch.jit.script cannot compile the dense model" in refused
    assert not (root / "not-scriptable").exists() or not any(
        p.name.startswith("ckpt-") for p in (root / "not-scriptable").iterdir())


@pytest.mark.processes
def test_staleness_and_a_small_byte_budget_train_under_fsdp(job) -> None:
    """``embedding_staleness=2`` with an NN-worker byte budget of one batch, under an
    ``FSDPOption()`` bounded by ``nn_worker_config.fsdp_max_unsharded_bytes``: every
    batch trained once, finite losses, the budget and the config's bound held, and
    the limiter prefetching within that bound."""
    stats, _ = job
    sizes, _ = FSDPOption().sizes(_dlrm(), 2)
    for rank in range(2):
        s = stats["stale-fsdp"][rank]
        assert s["steps"] == s["trained"] == STALE_STEPS, s
        assert np.isfinite(s["losses"]).all(), s["losses"]
        assert s["budget"] == STALE_BUDGET and 0 < s["budget_peak"] <= STALE_BUDGET, s
        assert s["bound"] == 2 * max(sizes) and 0 < s["peak"] <= s["bound"], s
        assert any(s["plan_forward"]), s["plan_forward"]
