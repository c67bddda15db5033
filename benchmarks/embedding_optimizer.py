"""The parameter servers' embedding Adagrad against ``torch.optim.Adagrad``: the same
model, data, initial rows and settings, in one process.

    python -m benchmarks.embedding_optimizer [--cases first_job,stream,adult] [--json PATH]

Each case trains its model twice per ``initial_accumulator_value`` (0.01, PERSIA's;
0.0, torch's): once with its embeddings in ``nn.Embedding`` tables stepped by
``torch.optim.Adagrad`` (plain PyTorch), once with them in the servers' ``EmbeddingTable``
(the kernels a job's parameter servers run), looked up and updated around each step as a
job with staleness 1 does. Both start from the table's initial rows (uniform in
[-0.01, 0.01], ``EmbeddingConfig``'s default) and the same dense weights.

- ``first_job``: the README's first job (its synthetic clicks, its model, Adagrad lr 0.05,
  dense Adam lr 0.01, 100k samples in batches of 256); test AUC on its 20k test samples.
- ``stream``: docs/online_training.md's job (``ClickModel``, Adagrad lr 0.05 for both)
  on a synthetic stream shaped like MovieLens-100k (943 users, 1,682 items with skewed
  popularity, 100k ratings, a click when a hidden user-item affinity says so), batches
  of 1024; progressive AUC (each batch scored before it is trained).
- ``adult``: ``examples/adult_income`` (PERSIA's model, Adagrad lr 0.01, dense SGD lr 0.1,
  batch 128, one epoch); test AUC. Needs ``../shared/data/adult.csv``.

Then once more with each side's default (``Adagrad(lr=...)`` and
``torch.optim.Adagrad(params, lr=...)``, as the examples write them).

JSON: ``{case: {"torch_acc0.01": auc, "persia_acc0.01": auc, "torch_acc0": auc,
"persia_acc0": auc, "torch_accdefault": auc, "persia_accdefault": auc}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import parse_args_with_smoke
from persia_py.embedding.optim import Adagrad
from persia_py.metrics import roc_auc
from persia_py.servers.storage import EmbeddingTable

ROOT = Path(__file__).resolve().parent.parent
ADULT_CSV = ROOT.parent / "shared" / "data" / "adult.csv"
SEED = 0

Batch = tuple[np.ndarray, list[np.ndarray], np.ndarray]
"""``(dense [n, k] float32, one uint64 id array [n] per slot, labels [n, 1] float32)``."""


@dataclass
class Case:
    """One model on one data set, with the optimizers its example or page uses."""

    make_model: Callable[[], torch.nn.Module]
    make_dense_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    embedding_lr: float
    dim: int
    train: Callable[[], Iterable[Batch]]
    test: Callable[[], Iterable[Batch]] | None
    """None: progressive AUC over the training batches."""


class _TorchEmbeddings:
    """Plain PyTorch: one ``nn.Embedding`` per slot over the ids the data holds."""

    def __init__(self, tables: list[EmbeddingTable], slot_ids: list[np.ndarray],
                 lr: float, initial_accumulator_value: float | None) -> None:
        self.index = [{int(i): k for k, i in enumerate(ids)} for ids in slot_ids]
        self.embeddings = []
        for table, ids in zip(tables, slot_ids, strict=True):
            embedding = torch.nn.Embedding(len(ids), table.dim)
            with torch.no_grad():
                embedding.weight.copy_(torch.from_numpy(table.lookup(ids, True)))
            self.embeddings.append(embedding)
        given = {} if initial_accumulator_value is None else {
            "initial_accumulator_value": initial_accumulator_value}
        self.optimizer = torch.optim.Adagrad([e.weight for e in self.embeddings], lr=lr, **given)

    def lookup(self, ids: list[np.ndarray]) -> list[torch.Tensor]:
        return [e(torch.tensor([index[int(i)] for i in slot])) for e, index, slot
                in zip(self.embeddings, self.index, ids, strict=True)]

    def step(self, ids: list[np.ndarray], tensors: list[torch.Tensor]) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


class _ServerEmbeddings:
    """The parameter servers' tables: rows looked up, gradients sent back, per step."""

    def __init__(self, dims: list[int], lr: float,
                 initial_accumulator_value: float | None) -> None:
        given = {} if initial_accumulator_value is None else {
            "initial_accumulator_value": initial_accumulator_value}
        optimizer = Adagrad(lr=lr, **given).config  # what a job's script passes
        self.tables = [EmbeddingTable(dim=dim, optimizer=optimizer, seed=SEED) for dim in dims]

    def lookup(self, ids: list[np.ndarray]) -> list[torch.Tensor]:
        return [torch.from_numpy(t.lookup(i, True)).requires_grad_()
                for t, i in zip(self.tables, ids, strict=True)]

    def step(self, ids: list[np.ndarray], tensors: list[torch.Tensor]) -> None:
        for table, slot, tensor in zip(self.tables, ids, tensors, strict=True):
            table.update(slot, tensor.grad.numpy())


def run(case: Case, backend: str, initial_accumulator_value: float | None) -> float:
    """Train ``case`` once with ``backend`` (``torch`` or ``persia``); its AUC.
    ``initial_accumulator_value`` None: each backend's own default."""
    train = list(case.train())
    num_slots = len(train[0][1])
    slot_ids = [np.unique(np.concatenate([b[1][s] for b in train]
                                         + [b[1][s] for b in (case.test() if case.test else [])]))
                for s in range(num_slots)]
    server = _ServerEmbeddings([case.dim] * num_slots, case.embedding_lr, initial_accumulator_value)
    if backend == "torch":
        embeddings = _TorchEmbeddings(server.tables, slot_ids, case.embedding_lr,
                                      initial_accumulator_value)
    else:
        embeddings = server
    torch.manual_seed(SEED)
    model = case.make_model()
    dense_optimizer = case.make_dense_optimizer(model)
    scores, labels = [], []
    for dense, ids, label in train:
        model.train()
        tensors = embeddings.lookup(ids)
        output = model([torch.from_numpy(dense)], tensors)
        if case.test is None:
            scores.append(output.detach().numpy().ravel())
            labels.append(label.ravel())
        loss = torch.nn.functional.binary_cross_entropy(output, torch.from_numpy(label))
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        embeddings.step(ids, tensors)
    if case.test is not None:
        model.eval()
        with torch.no_grad():
            for dense, ids, label in case.test():
                scores.append(model([torch.from_numpy(dense)], embeddings.lookup(ids)).numpy().ravel())
                labels.append(label.ravel())
    return roc_auc(np.concatenate(labels), np.concatenate(scores))


# -- the cases --------------------------------------------------------------------------


def first_job_case() -> Case:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_readme import first_job

    files, _ = first_job()
    names: dict = {"__name__": "first_job"}
    exec(files["data_loader.py"], names)  # noqa: S102 - the README's code, as written
    train_py = files["train.py"].split("\nmodel = Model()")[0].replace(
        "from data_loader import make_batch\n", "")
    model_names: dict = {"__name__": "first_job"}
    exec(train_py, model_names)  # noqa: S102 - the README's Model class

    def as_tuple(batch) -> Batch:
        return (batch.non_id_type_features[0].data, [f.ids for f in batch.id_type_features],
                batch.labels[0].data)

    def train() -> Iterable[Batch]:
        rng = np.random.default_rng(0)
        return [as_tuple(names["make_batch"](rng, 256)) for _ in range(100_000 // 256)]

    def test() -> Iterable[Batch]:
        rng = np.random.default_rng(1000)
        return [as_tuple(names["make_batch"](rng, 1000, requires_grad=False)) for _ in range(20)]

    return Case(make_model=model_names["Model"],
                make_dense_optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                embedding_lr=0.05, dim=8, train=train, test=test)


class _ClickModel(torch.nn.Module):
    """docs/online_training.md's model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1 + 8 + 8, 1)

    def forward(self, non_id_tensors, embedding_tensors):
        return torch.sigmoid(self.linear(torch.cat([non_id_tensors[0], *embedding_tensors], dim=1)))


def stream_case(num_samples: int = 100_000) -> Case:
    def train() -> Iterable[Batch]:
        rng = np.random.default_rng(7)
        num_users, num_items = 943, 1682
        user_factors = rng.normal(size=(num_users, 4))
        item_factors = rng.normal(size=(num_items, 4))
        item_bias = rng.normal(size=num_items)
        popularity = 1.0 / np.arange(1, num_items + 1) ** 0.8
        users = rng.integers(0, num_users, num_samples)
        items = rng.choice(num_items, num_samples, p=popularity / popularity.sum())
        x = rng.normal(size=num_samples).astype(np.float32)
        logit = (user_factors[users] * item_factors[items]).sum(1) / 2 + item_bias[items] + 0.5 * x
        clicks = (rng.random(num_samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return [(x[s:s + 1024, None], [users[s:s + 1024].astype(np.uint64),
                                       items[s:s + 1024].astype(np.uint64)],
                 clicks[s:s + 1024, None]) for s in range(0, num_samples, 1024)]

    return Case(make_model=_ClickModel,
                make_dense_optimizer=lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),
                embedding_lr=0.05, dim=8, train=train, test=None)


def adult_case() -> Case:
    sys.path.insert(0, str(ROOT / "examples" / "adult_income"))
    from adult_data import batches
    from model import DNN

    return Case(make_model=DNN,
                make_dense_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                embedding_lr=0.01, dim=8,
                train=lambda: list(batches(ADULT_CSV, "train", 128)),
                test=lambda: list(batches(ADULT_CSV, "test", 1024)))


CASES = {"first_job": first_job_case, "stream": stream_case, "adult": adult_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--stream-samples", type=int, default=100_000,
                        help="samples of the MovieLens-shaped stream case")
    parser.add_argument("--json", default=None)
    args = parse_args_with_smoke(parser, None, cases="stream", stream_samples=2_000)
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for name in args.cases.split(","):
        if name == "adult" and not ADULT_CSV.exists():
            print(f"adult: skipped, {ADULT_CSV} is absent", flush=True)
            continue
        case = stream_case(args.stream_samples) if name == "stream" else CASES[name]()
        results[name] = {}
        for acc in (0.01, 0.0, None):
            for backend in ("torch", "persia"):
                auc = run(case, backend, acc)
                label = "default" if acc is None else f"{acc:g}"
                results[name][f"{backend}_acc{label}"] = auc
                print(f"{name}: initial_accumulator_value {label}, {backend}: AUC {auc:.4f}",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
