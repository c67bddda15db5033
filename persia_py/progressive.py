"""Progressive validation: every training batch is scored before it is trained on.

In online training there is no held-out test set: tomorrow's data is not there yet. But
the forward pass of a training step runs before that batch's update, so its outputs are
honest predictions on unseen data (Blum, Kalai & Langford, 1999; what online recommender
systems report). :class:`ProgressiveValidation` collects them; every ``every_steps``
steps the ranks add up their sums (:class:`persia_py.metrics.BinaryStats`, one
all-reduce) and the training log gets ``pv_auc``, ``pv_logloss``, ``pv_ne`` (and
``pv_gauc`` with ``group_by``) of the samples of those steps, which
``persia-launcher plot`` draws with the other AUCs. Windows end at the multiples of
``every_steps`` of the job's step (the record's ``step``), across a resume too; when the
training ends (a signal, the end of the stream) the steps since the last report are
reported as a shorter window, so every sample trained is in exactly one report.

    pv = ProgressiveValidation(every_steps=50, group_by=lambda batch: user_ids(batch))
    with TrainCtx(..., progressive_validation=pv) as ctx: ...

The model's first output must be click probabilities (after the sigmoid), its first
label 0/1. A rank that ran out of batches takes part in the others' reductions through
its :class:`~torch.distributed.algorithms.join.JoinHook`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.algorithms.join import JoinHook

from persia_py.dense.collectives import WorldJoinable, all_gather_arrays
from persia_py.metrics import BinaryStats, gauc

__all__ = ["ProgressiveValidation"]


class ProgressiveValidation(WorldJoinable):
    """Running AUC, log loss and NE of each batch's pre-update scores (see the module doc).

    Args:
        every_steps: steps (of each rank) between two reports.
        group_by: optional; a batch -> int64 group of each sample (e.g. the user id, from
            a dense feature or the batch's meta bytes); adds ``pv_gauc``.
        num_bins: score bins of the AUC histogram.
    """

    def __init__(self, *, every_steps: int = 100,
                 group_by: Callable[[object], np.ndarray] | None = None,
                 num_bins: int = 1 << 14) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = every_steps
        self.group_by = group_by
        self.num_bins = num_bins
        self._on_report: Callable[[dict[str, float]], None] | None = None
        self.steps = 0
        """The job's step (``TrainState.job_step``: the same on every rank); a report is
        due at each multiple of ``every_steps``."""
        self._window_steps = 0
        self.last: dict[str, float] = {}
        """The values of the last report."""
        self._reset()
        super().__init__()

    def _reset(self) -> None:
        self.stats = BinaryStats(self.num_bins)
        self._labels: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._groups: list[np.ndarray] = []

    def observe(self, batch, output: torch.Tensor, labels: list[torch.Tensor]) -> None:
        """Record one training batch's scores (its forward output, before its update)."""
        first = output[0] if isinstance(output, (list, tuple)) else output
        scores = first.detach().float().cpu().numpy().reshape(-1)
        label = labels[0].detach().float().cpu().numpy().reshape(-1)
        if scores.shape != label.shape:
            raise ValueError(f"progressive validation: the model's output has {scores.size} "
                             f"scores, the first label {label.size} values; it needs one "
                             "click probability per sample")
        self.stats.update(label, scores)
        if self.group_by is not None:
            groups = np.asarray(self.group_by(batch), dtype=np.int64).reshape(-1)
            if groups.shape != label.shape:
                raise ValueError(f"progressive validation: group_by gave {groups.size} groups "
                                 f"for {label.size} samples")
            self._labels.append(label)
            self._scores.append(scores)
            self._groups.append(groups)

    def start_at(self, step: int) -> None:
        """Count on from the job's ``step`` (a resumed training): windows end at the same
        multiples of ``every_steps`` as in the run before."""
        self.steps = step

    def after_step(self) -> dict[str, float] | None:
        """After each training step (every rank): the report when one is due, else None."""
        self.steps += 1
        self._window_steps += 1
        if self.steps % self.every_steps:
            return None
        return self._report()

    def report_partial(self) -> dict[str, float] | None:
        """When training ends (every rank): the report of the steps since the last one,
        if any, so that every sample trained is in one report; else None."""
        return self._report() if self._window_steps else None

    def _report(self) -> dict[str, float]:
        total = self.stats.all_reduced(self.join_device)
        values = {"pv_samples": total.count}
        for key, metric in (("pv_auc", total.auc), ("pv_logloss", total.log_loss),
                            ("pv_ne", total.normalized_entropy)):
            values[key] = _or_nan(metric)
        if self.group_by is not None:
            values["pv_gauc"] = _or_nan(lambda: gauc(*self._gathered()))
        self._reset()
        self._window_steps = 0
        self.last = values
        if self._on_report is not None:
            self._on_report(values)
        return values

    def _gathered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        device = self.join_device

        def every(parts: list[np.ndarray], dtype) -> np.ndarray:
            mine = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
            return all_gather_arrays(mine, device)

        return (every(self._labels, np.float64), every(self._scores, np.float64),
                every(self._groups, np.int64))

    def bind(self, device: torch.device,
             on_report: Callable[[dict[str, float]], None] | None = None) -> None:
        """Run the collectives for the rank whose model is on ``device``, and hand every
        report to ``on_report`` (``TrainCtx``: the training log), also those made while
        this rank, out of batches, joins the others' steps."""
        self._device = device
        self._on_report = on_report

    def join_hook(self, **kwargs) -> JoinHook:
        return _ReportJoinHook(self)


class _ReportJoinHook(JoinHook):
    """A rank out of batches counts the others' steps and joins their reports (with
    nothing of its own since its last)."""

    def __init__(self, pv: ProgressiveValidation) -> None:
        self._pv = pv

    def main_hook(self) -> None:
        self._pv.after_step()


def _or_nan(metric: Callable[[], float]) -> float:
    """The metric, or NaN when the window cannot give one (e.g. one class only)."""
    try:
        return metric()
    except ValueError:
        return math.nan
