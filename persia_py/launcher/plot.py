"""``persia-launcher plot``: loss, AUC and throughput over steps from a JSON-lines training log.

Needs matplotlib (``pip install persia_py[plot]``); nothing else in persia_py does.
"""

from __future__ import annotations

import json
import os

import numpy as np


def read_training_log(path: str | os.PathLike) -> list[dict]:
    """The records of a training log; ValueError naming the line of a malformed one."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object: {exc}") from None
            if not isinstance(record, dict) or not ("step" in record or "event" in record):
                raise ValueError(f"{path}:{number}: a record needs a 'step' field (or an "
                                 "'event' one: a restart, a resume)")
            records.append(record)
    return records


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if values.size < window or window < 2:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[:window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot_training_log(log_path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Write a PNG with three panels (loss, AUC, samples/s) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_training_log(log_path)
    steps = [r for r in records if "loss" in r]
    if not records:
        raise ValueError(f"{log_path}: the training log is empty")
    auc_keys = sorted({k for r in records for k in r if "auc" in k.lower()})

    fig, (ax_loss, ax_auc, ax_rate) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    if steps:
        x = np.array([r["step"] for r in steps])
        loss = np.array([r["loss"] for r in steps], dtype=float)
        ax_loss.plot(x, loss, alpha=0.3, linewidth=0.8, label="loss")
        ax_loss.plot(x, _smooth(loss, max(1, len(loss) // 50)), label="loss (moving mean)")
        ax_rate.plot(x, [r.get("samples_per_sec", np.nan) for r in steps])
    pv = [(r["step"], r["pv_logloss"]) for r in records if "pv_logloss" in r]
    if pv:  # progressive validation (persia_py.progressive): log loss before training
        ax_loss.plot(*zip(*pv), marker="o", label="pv_logloss")
    if steps or pv:
        ax_loss.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"training log {os.path.basename(os.fspath(log_path))}")
    for key in auc_keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        ax_auc.plot(*zip(*points), marker="o", label=key)
    if auc_keys:
        ax_auc.legend()
    else:
        ax_auc.text(0.5, 0.5, "no AUC recorded (ctx.log(test_auc=...))", ha="center",
                    va="center", transform=ax_auc.transAxes)
    ax_auc.set_ylabel("AUC")
    ax_rate.set_ylabel("samples/s")
    ax_rate.set_xlabel("step")
    for ax in (ax_loss, ax_auc, ax_rate):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, format="png", dpi=100)
    plt.close(fig)
