"""Evaluation metrics of click models, vectorized with numpy; distributed across NN ranks.

Single process: :func:`roc_auc` (exact, rank-based), :func:`log_loss`,
:func:`normalized_entropy` and :func:`gauc` (per-group AUC, weighted by group size, as
reported for online recommender systems).

Across NN-worker ranks (each holding its own samples): :class:`BinaryStats` keeps sums
(a histogram of scores per class, the summed log loss, the counts) that one
``all_reduce`` adds up, so AUC, log loss and NE of every rank's samples together come
out on every rank without moving the samples; :func:`distributed_gauc` all-gathers
(group, label, score) triples, since a group's samples may lie on several ranks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from persia_py.dense.collectives import all_gather_arrays

__all__ = ["BinaryStats", "distributed_gauc", "gauc", "log_loss", "normalized_entropy", "roc_auc"]

_EPS = 1e-7
"""Scores are clipped to [eps, 1 - eps] in log losses (a score of exactly 0 or 1)."""


def _check(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels {labels.shape} and scores {scores.shape} differ in shape")
    if labels.size and not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0 or 1")
    return labels.astype(bool), scores


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U), ties given half credit.

    ValueError when only one class is present.
    """
    labels = np.asarray(labels).reshape(-1).astype(bool)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels {labels.shape} and scores {scores.shape} differ in shape")
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank within runs of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    average = (starts + ends - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, ends - starts)
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def _loss_sum(labels: np.ndarray, scores: np.ndarray) -> float:
    p = np.clip(scores, _EPS, 1 - _EPS)
    return float(-np.where(labels, np.log(p), np.log1p(-p)).sum())


def _entropy(ctr: float) -> float:
    """Log loss of always predicting the mean label ``ctr`` (NE's denominator)."""
    ctr = min(max(ctr, _EPS), 1 - _EPS)
    return -(ctr * np.log(ctr) + (1 - ctr) * np.log1p(-ctr))


def log_loss(labels: np.ndarray, scores: np.ndarray) -> float:
    """Mean binary cross-entropy of click probabilities ``scores`` (clipped to
    [1e-7, 1 - 1e-7]); ValueError on no samples."""
    labels, scores = _check(labels, scores)
    if not labels.size:
        raise ValueError("log loss needs at least one sample")
    return _loss_sum(labels, scores) / labels.size


def normalized_entropy(labels: np.ndarray, scores: np.ndarray) -> float:
    """Log loss divided by the entropy of the mean label (He et al., 2014): below 1 means
    better than always predicting the average click rate."""
    labels, scores = _check(labels, scores)
    return log_loss(labels, scores) / _entropy(float(labels.mean()))


def gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> float:
    """Group AUC: the AUC of each group (e.g. each user) weighted by its number of samples;
    groups with one class only are left out. ValueError when no group has both."""
    labels, scores = _check(labels, scores)
    groups = np.asarray(groups).reshape(-1)
    if groups.shape != labels.shape:
        raise ValueError(f"groups {groups.shape} and labels {labels.shape} differ in shape")
    order = np.lexsort((scores, groups))  # by group, then score
    g, s, y = groups[order], scores[order], labels[order]
    n = g.size
    group_start = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if n else np.zeros(0, np.int64)
    # Runs of equal (group, score) share their average rank within the group.
    run_start = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (s[1:] != s[:-1])]) if n else \
        np.zeros(0, np.int64)
    run_end = np.r_[run_start[1:], n]
    position = np.repeat((run_start + run_end - 1) / 2.0, run_end - run_start)
    group_of = np.repeat(np.arange(group_start.size), np.diff(np.r_[group_start, n]))
    ranks = position - group_start[group_of] + 1.0
    size = np.diff(np.r_[group_start, n]).astype(np.float64)
    pos = np.bincount(group_of, weights=y, minlength=group_start.size)
    neg = size - pos
    rank_sum = np.bincount(group_of, weights=ranks * y, minlength=group_start.size)
    both = (pos > 0) & (neg > 0)
    if not both.any():
        raise ValueError("GAUC needs a group with both positive and negative labels")
    auc = (rank_sum[both] - pos[both] * (pos[both] + 1) / 2.0) / (pos[both] * neg[both])
    return float((auc * size[both]).sum() / size[both].sum())


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class BinaryStats:
    """Sums of one or several ranks' (label, score) pairs: AUC, log loss and NE of them.

    ``update`` adds a batch (vectorized); ``all_reduced()`` adds every rank's sums up
    (one ``all_reduce``; every rank calls it). The AUC comes from ``num_bins``
    equal-width score bins, pairs within a bin counted as ties: it differs from the
    exact :func:`roc_auc` by at most the share of positive-negative pairs sharing a bin.
    """

    def __init__(self, num_bins: int = 1 << 14) -> None:
        if num_bins < 2:
            raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        self.num_bins = num_bins
        self.pos = np.zeros(num_bins, np.float64)
        self.neg = np.zeros(num_bins, np.float64)
        self.loss_sum = 0.0
        self.count = 0.0
        self.positives = 0.0

    def update(self, labels, scores) -> None:
        """Add samples: ``labels`` 0/1 and ``scores`` click probabilities in [0, 1]."""
        labels, scores = _check(labels, scores)
        if scores.size and not ((scores >= 0) & (scores <= 1)).all():
            raise ValueError("scores must be probabilities in [0, 1] (apply a sigmoid first)")
        bins = np.minimum((scores * self.num_bins).astype(np.int64), self.num_bins - 1)
        self.pos += np.bincount(bins[labels], minlength=self.num_bins)
        self.neg += np.bincount(bins[~labels], minlength=self.num_bins)
        self.loss_sum += _loss_sum(labels, scores)
        self.count += labels.size
        self.positives += float(labels.sum())

    def _packed(self) -> np.ndarray:
        return np.concatenate([self.pos, self.neg, [self.loss_sum, self.count, self.positives]])

    def all_reduced(self, device: torch.device | None = None) -> BinaryStats:
        """Every rank's sums added up (a copy; this rank's own when not distributed).
        ``device``: where the collective runs (a CUDA device under NCCL)."""
        total = BinaryStats(self.num_bins)
        packed = self._packed()
        if _world() > 1:
            tensor = torch.from_numpy(packed).to(device or torch.device("cpu"))
            dist.all_reduce(tensor)
            packed = tensor.cpu().numpy()
        n = self.num_bins
        total.pos, total.neg = packed[:n].copy(), packed[n:2 * n].copy()
        total.loss_sum, total.count, total.positives = (float(v) for v in packed[2 * n:])
        return total

    def auc(self) -> float:
        """AUC from the histograms; ValueError when one class is missing."""
        num_pos, num_neg = self.pos.sum(), self.neg.sum()
        if num_pos == 0 or num_neg == 0:
            raise ValueError("AUC needs both positive and negative labels")
        neg_below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        return float((self.pos * (neg_below + 0.5 * self.neg)).sum() / (num_pos * num_neg))

    def log_loss(self) -> float:
        if not self.count:
            raise ValueError("log loss needs at least one sample")
        return self.loss_sum / self.count

    def normalized_entropy(self) -> float:
        return self.log_loss() / _entropy(self.positives / self.count)


def distributed_gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray,
                     device: torch.device | None = None) -> float:
    """:func:`gauc` of every rank's samples together (each rank passes its own; all
    ranks call it and get the same value)."""
    labels, scores = _check(labels, scores)
    groups = np.asarray(groups, dtype=np.int64).reshape(-1)
    return gauc(all_gather_arrays(labels.astype(np.int64), device),
                all_gather_arrays(scores, device), all_gather_arrays(groups, device))
