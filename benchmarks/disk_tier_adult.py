"""UCI Adult trained with most embedding rows on a disk tier, beside all in RAM
(``auc_delta_adult`` of ``benchmarks.disk_tier``; issue 42: within 0.001 test AUC).

One process, a real ``EmbeddingTable`` holding the rows of the 8 slots of
``examples/adult_income`` (their ids are distinct: a hash of slot and value; dim 8,
Adagrad lr 0.01) and the example's model (``DNN``, SGD lr 0.1, torch seed 3), the
hybrid algorithm at staleness 1: per batch, look the batch's ids up (training),
forward, backward, update the rows with their gradients. Twice, the same seeds and batch
order: every row in RAM, then a RAM capacity of 32 rows, the most one batch of 4
samples can need (8 ids a sample), so that at least 70 of the 102 rows are on the tier
at any time and come back as batches touch them; then test AUC on the standard test
split looked up the same way (inference lookups bring disk rows back too). The Adult
vocabulary is so small (2 to 42 values a slot) that only 4-sample batches force most rows
to disk; the model is not tuned for them (its AUC is below the example's), but both runs
share them.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from benchmarks.density_accuracy import ADULT, ADULT_CSV
from persia_py.config import DiskTierConfig
from persia_py.metrics import roc_auc
from persia_py.servers.optimizers import AdagradConfig
from persia_py.servers.storage import EmbeddingTable

__all__ = ["adult_figures"]

BATCH = 4
"""Samples per batch."""
DIM = 8


def _data(smoke: bool) -> tuple[tuple, tuple]:
    if not ADULT_CSV.exists():
        raise FileNotFoundError(f"{ADULT_CSV} is absent (UCI Adult, see "
                                f"examples/adult_income/README.md)")
    sys.path.insert(0, str(ADULT))
    from adult_data import load_split  # the example's own reader

    train, test = load_split(ADULT_CSV, "train"), load_split(ADULT_CSV, "test")
    if smoke:  # a slice: seconds, not minutes
        train = (train[0][:1_000], [i[:1_000] for i in train[1]], train[2][:1_000])
        test = (test[0][:500], [i[:500] for i in test[1]], test[2][:500])
    return train, test


def _run(train: tuple, test: tuple, tier_dir: str | None) -> dict:
    """One epoch, then the test AUC; with ``tier_dir``: RAM holds ``BATCH`` rows a table."""
    sys.path.insert(0, str(ADULT))
    from model import DNN

    num_slots = len(train[1])
    tier = None if tier_dir is None else DiskTierConfig(path=tier_dir, capacity_rows=10_000)
    table = EmbeddingTable(dim=DIM, optimizer=AdagradConfig(lr=0.01), seed=3,
                           capacity=BATCH * num_slots if tier else 10_000, disk_tier=tier)
    torch.manual_seed(3)
    model = DNN(num_slots=num_slots, dim=DIM)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.BCELoss()
    most_on_disk = 0
    try:
        dense, ids, labels = train
        model.train()
        for start in range(0, labels.shape[0] - BATCH + 1, BATCH):  # BatchNorm: full batches
            # Sample-major: row i * num_slots + k is sample i's id of slot k.
            batch_ids = np.stack([i[start:start + BATCH] for i in ids], axis=1).reshape(-1)
            emb = torch.from_numpy(table.lookup(batch_ids, True)).requires_grad_()
            output = model([torch.from_numpy(dense[start:start + BATCH])],
                           list(emb.view(BATCH, num_slots, DIM).unbind(1)))
            optimizer.zero_grad()
            loss_fn(output, torch.from_numpy(labels[start:start + BATCH])).backward()
            optimizer.step()
            assert emb.grad is not None
            table.update(batch_ids, emb.grad.numpy())
            if tier:
                most_on_disk = max(most_on_disk, table.disk_stats()["disk_rows"])
        dense, ids, labels = test
        model.eval()
        preds = []
        with torch.no_grad():
            for start in range(0, labels.shape[0], BATCH):
                batch_ids = np.stack([i[start:start + BATCH] for i in ids], axis=1).reshape(-1)
                emb = torch.from_numpy(table.lookup(batch_ids, False))
                preds.append(model([torch.from_numpy(dense[start:start + BATCH])],
                                   list(emb.view(-1, num_slots, DIM).unbind(1))
                                   ).numpy().reshape(-1))
        disk = table.disk_stats() if tier else {"disk_rows": 0, "restored": 0}
        return {"auc": roc_auc(labels.reshape(-1), np.concatenate(preds)),
                "rows": table.stats()["entries"] + disk["disk_rows"],
                "most_on_disk": most_on_disk, "restored": disk["restored"]}
    finally:
        table.close()


def adult_figures(directory: str, smoke: bool) -> dict:
    """``auc_delta_adult`` (tier minus all in RAM) and what stands behind it."""
    train, test = _data(smoke)
    # One thread: at 4 samples a batch torch's thread pool only waits on itself (on a
    # busy machine, 50 ms a batch norm).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ram = _run(train, test, None)
        tier = _run(train, test, directory)
    finally:
        torch.set_num_threads(threads)
    figures = {"auc_adult_ram": ram["auc"], "auc_adult_tier": tier["auc"],
               "auc_delta_adult": tier["auc"] - ram["auc"],
               "adult_rows": tier["rows"],
               "adult_disk_row_fraction": tier["most_on_disk"] / max(tier["rows"], 1),
               "adult_rows_restored": tier["restored"]}
    print(f"adult: test AUC {ram['auc']:.5f} all in RAM, {tier['auc']:.5f} with "
          f"{tier['most_on_disk']} of {tier['rows']} rows on disk at most, "
          f"{tier['restored']} rows brought back; delta {figures['auc_delta_adult']:+.5f}")
    return figures
