"""NN worker of the FSDP tests: the Criteo-shaped DLRM on batches made in each rank (its
own part of the synthetic data, with ids that no other rank uses, so that every rank's
embedding rows depend only on its own updates and a 2-rank run is deterministic).

One torchrun launch runs every phase the tests check, in turn, on one process group and
one parameter server (``--phase`` runs one alone, as the 1-rank DDP step does):

1. ``ddp``: DDP from the ordinary (CPU) build; checkpoint ``init`` before training,
   ``STEPS`` steps, checkpoint ``ddp``.
2. ``fsdp``: FSDP with ``max_unsharded_bytes`` = two of the largest unit, the tower built
   by ``build_on_meta``: its gathered initial weights are compared with ``init``'s; then
   ``init`` is loaded (the servers' rows back to where DDP started), ``STEPS`` steps,
   checkpoint ``fsdp``.
3. ``ddp1``: rank 0 runs this script as a 1-rank job in a new process (no process group;
   rank 1 waits at a barrier): load ``fsdp``, checkpoint ``b`` (the whole-model format).
4. ``fsdp-load``: FSDP from the ordinary build: load ``b``, checkpoint ``c``.
5. ``uneven-ddp`` / ``uneven-fsdp``: from ``init``, rank 0 gets ``UNEVEN[0]`` batches and
   rank 1 ``UNEVEN[1]``: the rank out of batches joins the other's steps (``Join``);
   with DDP (the reference) then FSDP, the latter with a periodic checkpoint every
   ``PERIOD`` steps; checkpoints ``uneven-ddp`` and ``uneven-fsdp``.
6. ``empty-ddp`` / ``empty-fsdp``: the same with ``EMPTY``: rank 0 gets no batch at all.
7. ``amp-ddp`` / ``amp-fsdp``: from ``init``, ``AMP_STEPS`` steps under
   ``mixed_precision=True`` (bfloat16 autocast on the CPU).
8. ``nan-ddp`` / ``nan-fsdp``: from ``init``, ``NAN_STEPS`` steps; at step ``NAN_AT`` rank
   0's loss is NaN: the gathered dense weights around that step, the skipped-step
   count, and whether the ranks agree that gradients are not finite when only rank 0's
   shard of one gradient is NaN; checkpoints ``nan-ddp`` and ``nan-fsdp``.
9. ``stale-fsdp``: ``FSDPOption()`` bounded by the config's
   ``nn_worker_config.fsdp_max_unsharded_bytes`` (two of the largest unit), with
   ``embedding_staleness=2`` and ``nn_worker_config.max_buffer_bytes`` of ``STALE_BUDGET``
   (room for one batch, not two), ``STALE_STEPS`` steps on the rows as the phases before
   left them.

Every phase that compares losses reads its batches in ``reproducible`` mode (staleness
1, one lookup at a time, in each rank's own order).

The FSDP phase's tower is :class:`ScriptableDLRM` (the example's, written so that
TorchScript compiles it) and checkpoint ``fsdp`` carries ``jit_dense.pt``; ``fsdp-load``
asks for it with the example's DLRM, which TorchScript cannot compile.

Each phase writes ``<out>/<phase>-rank<r>.json`` (losses, the limiter's figures)."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "criteo_synthetic"
sys.path.insert(0, str(EXAMPLE))

from data_generator import SLOT_NAMES, make_batches  # noqa: E402
from model import DLRM  # noqa: E402

from persia_py.checkpoint import layout as fmt  # noqa: E402
from persia_py.config import load_global_config  # noqa: E402
from persia_py.ctx import TrainCtx  # noqa: E402
from persia_py.data import DataLoader, IterableDataset  # noqa: E402
from persia_py.dense.process_group import init_process_group  # noqa: E402
from persia_py.distributed import DDPOption, FSDPOption, build_on_meta  # noqa: E402
from persia_py.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from persia_py.embedding.optim import Adagrad  # noqa: E402
from persia_py.env import PersiaEnv  # noqa: E402

BATCH = 64
STEPS = 30
UNEVEN = (3, 6)
PERIOD = 2
EMPTY = (0, 3)
AMP_STEPS = 10
NAN_STEPS, NAN_AT = 5, 3
STALE_STEPS, STALE_BUDGET = 8, 256 << 10  # a batch holds about 170 KB with its gradients
PHASES = ("ddp", "fsdp", "ddp1", "fsdp-load", "uneven-ddp", "uneven-fsdp", "empty-ddp",
          "empty-fsdp", "amp-ddp", "amp-fsdp", "nan-ddp", "nan-fsdp", "stale-fsdp")


class ScriptableDLRM(DLRM):
    """The example's tower with a forward TorchScript compiles (no starred list)."""

    def forward(self, non_id_tensors: list[torch.Tensor],
                embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        dense = self.bottom(non_id_tensors[0])
        vectors = torch.stack([dense] + embedding_tensors, dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        pairs = dots[:, self.pair_rows, self.pair_cols]
        return torch.sigmoid(self.top(torch.cat([dense, pairs], dim=1)))


class RankBatches(IterableDataset):
    def __init__(self, steps: int, rank: int, world: int) -> None:
        super().__init__(buffer_size=4)
        self.steps, self.rank, self.world = steps, rank, world

    def __iter__(self):
        for dense, ids, labels in make_batches("train", self.steps * BATCH * self.world, BATCH,
                                               part=self.rank, num_parts=self.world):
            yield PersiaBatch(
                [IDTypeFeatureWithSingleID(n, i * 2 + self.rank) for n, i in zip(SLOT_NAMES, ids)],
                non_id_type_features=[NonIDTypeFeature(dense)], labels=[Label(labels)])


def _train(ctx: TrainCtx, env: PersiaEnv, steps: int, staleness: int = 1) -> list[float]:
    """``steps`` batches of this rank; at staleness 1 in reproducible mode (as each rank
    makes its own batches, reproducible with several ranks too: see docs/fsdp.md)."""
    losses = []
    for batch in DataLoader(RankBatches(steps, env.rank, env.world_size),
                            reproducible=staleness == 1, embedding_staleness=staleness):
        output, labels = ctx.forward(batch)
        loss = torch.nn.functional.binary_cross_entropy(output.float(), labels[0])
        ctx.backward(loss)
        losses.append(loss.item())
    ctx.flush()
    return losses


def _nan_phase(ctx: TrainCtx, env: PersiaEnv) -> dict:
    """Rank 0's loss is NaN at step NAN_AT: the gathered weights just before and after
    that step; then whether the ranks agree that the gradients are not finite when one
    value of rank 0's shard of one gradient is NaN."""
    losses, around = [], {}
    for step, batch in enumerate(
            DataLoader(RankBatches(NAN_STEPS, env.rank, env.world_size), embedding_staleness=1),
            1):
        if step == NAN_AT:
            around["before"] = _gathered(ctx.model)
        output, labels = ctx.forward(batch)
        loss = torch.nn.functional.binary_cross_entropy(output.float(), labels[0])
        if step == NAN_AT and env.rank == 0:
            loss = loss * float("nan")
        ctx.backward(loss)
        if step == NAN_AT:
            around["after"] = _gathered(ctx.model)
        losses.append(loss.item())
    ctx.flush()
    before, after = around["before"], around["after"]
    unchanged = sorted(k for k in before if torch.equal(before[k], after[k]))
    params = [p for g in ctx.dense_optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    if env.rank == 0:
        grad = params[0].grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
    partial_nan_finite = ctx.dense.grads_finite(ctx.dense_optimizer)
    ctx.dense_optimizer.zero_grad(set_to_none=True)
    return {"steps": len(losses), "losses": losses, "unchanged": unchanged,
            "keys": sorted(before), "skipped": ctx.num_dense_steps_skipped,
            "partial_nan_finite": partial_nan_finite}


def _ctx(model: torch.nn.Module, option, **kwargs) -> TrainCtx:
    return TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.05),
                    dense_optimizer=torch.optim.Adagrad(model.parameters(), lr=0.05),
                    distributed_option=option, **kwargs)


def _two_units(model: torch.nn.Module, world: int) -> int:
    sizes, _ = FSDPOption().sizes(model, world)
    return 2 * max(sizes)


def _stats(ctx: TrainCtx, losses: list[float], **extra) -> dict:
    meter = getattr(ctx.dense, "meter", None)
    return {"steps": len(losses), "losses": losses,
            "trained": ctx.train_state.state_dict()["steps"],
            "peak": None if meter is None else meter.peak,
            "bound": None if meter is None else meter.bound,
            "plan_forward": None if meter is None else meter.plan_forward,
            "budget_peak": ctx.budget.peak, "budget": ctx.budget.capacity, **extra}


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _ddp1(root: Path, out: Path) -> None:
    """Rank 0: this script as a 1-rank job in a new process, without torchrun's settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_", "LOCAL_WORLD"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    subprocess.run([sys.executable, __file__, "--phase", "ddp1", "--root", str(root),
                    "--out", str(out)], env=env, check=True, timeout=300)


def run(phase: str, env: PersiaEnv, root: Path, out: Path) -> None:
    stats = None
    if phase == "ddp":
        torch.manual_seed(0)
        with _ctx(DLRM(), DDPOption()) as ctx:
            ctx.dump_checkpoint(str(root / "init"))
            stats = _stats(ctx, _train(ctx, env, STEPS))
            ctx.dump_checkpoint(str(root / "ddp"))
    elif phase == "fsdp":
        torch.manual_seed(0)
        model = build_on_meta(ScriptableDLRM)
        option = FSDPOption(max_unsharded_bytes=_two_units(model, env.world_size))
        with _ctx(model, option) as ctx:
            built = _gathered(ctx.model)
            init = fmt.load_tensors(fmt.resolve(root / "init"), "dense-model")
            differ = sorted(k for k in init if not torch.equal(init[k], built[k]))
            ctx.load_checkpoint(str(root / "init"))
            stats = _stats(ctx, _train(ctx, env, STEPS), meta_build_differs=differ,
                           meta_build_keys=sorted(built))
            ctx.dump_checkpoint(str(root / "fsdp"), with_jit_model=True)
    elif phase == "ddp1" and env.world_size == 1:
        with _ctx(DLRM(), DDPOption()) as ctx:
            ctx.load_checkpoint(str(root / "fsdp"))
            ctx.dump_checkpoint(str(root / "b"))
    elif phase == "ddp1":
        if env.rank == 0:
            _ddp1(root, out)
        dist.barrier()
    elif phase == "fsdp-load":
        with _ctx(DLRM(), FSDPOption()) as ctx:
            ctx.load_checkpoint(str(root / "b"))
            try:
                ctx.dump_checkpoint(str(root / "not-scriptable"), with_jit_model=True)
                refused = None
            except ValueError as exc:
                refused = str(exc)
            ctx.dump_checkpoint(str(root / "c"))
        stats = {"jit_refused": refused, "steps": 0}
    elif phase.startswith(("uneven-", "empty-")):
        config = load_global_config(env.global_config)
        option = DDPOption()
        if phase == "uneven-fsdp":
            option = FSDPOption()
            config = dataclasses.replace(config, checkpoint_config=dataclasses.replace(
                config.checkpoint_config, dir=str(root / "periodic"), every_steps=PERIOD))
        elif phase == "empty-fsdp":
            option = FSDPOption()
        counts = UNEVEN if phase.startswith("uneven-") else EMPTY
        with _ctx(DLRM(), option, global_config=config) as ctx:
            ctx.load_checkpoint(str(root / "init"))
            stats = _stats(ctx, _train(ctx, env, counts[env.rank]))
            ctx.dump_checkpoint(str(root / phase))
    elif phase in ("amp-ddp", "amp-fsdp", "nan-ddp", "nan-fsdp"):
        option = FSDPOption() if phase.endswith("fsdp") else DDPOption()
        with _ctx(DLRM(), option, mixed_precision=phase.startswith("amp")) as ctx:
            ctx.load_checkpoint(str(root / "init"))
            if phase.startswith("amp"):
                stats = _stats(ctx, _train(ctx, env, AMP_STEPS))
            else:
                stats = _nan_phase(ctx, env)
                ctx.dump_checkpoint(str(root / phase))
    elif phase == "stale-fsdp":
        torch.manual_seed(0)
        model = DLRM()
        config = load_global_config(env.global_config)
        config = dataclasses.replace(config, nn_worker_config=dataclasses.replace(
            config.nn_worker_config, max_buffer_bytes=STALE_BUDGET,
            fsdp_max_unsharded_bytes=_two_units(model, env.world_size)))
        with _ctx(model, FSDPOption(), global_config=config) as ctx:
            stats = _stats(ctx, _train(ctx, env, STALE_STEPS, staleness=2))
    else:
        raise ValueError(phase)
    if stats is not None:
        (out / f"{phase}-rank{env.rank}.json").write_text(json.dumps(stats))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="the job's checkpoint root")
    parser.add_argument("--out", required=True, help="folder for losses and stats")
    parser.add_argument("--phase", choices=PHASES, default=None, help="only this phase")
    args = parser.parse_args()
    env = PersiaEnv.from_environ()
    root, out = Path(args.root), Path(args.out)
    if env.world_size > 1:  # one group for every phase (TrainCtx leaves it as it is)
        init_process_group("gloo", load_global_config(env.global_config).common_config)
    for phase in [args.phase] if args.phase else PHASES:
        run(phase, env, root, out)
        print(f"phase {phase} done", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
