"""Batch data types (as PERSIA's ``persia.embedding.data``).

ID-type features are stored in CSR form (flat uint64 ids and per-sample lengths), which
is what travels on the wire. Every check raises ``ValueError`` naming the feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

MAX_BATCH_SIZE = 1 << 24

_NDARRAY_DTYPES = frozenset(
    [np.bool_, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint8]
)


class IDTypeFeature:
    """A categorical feature with a variable number of ids per sample (LIL form).

    ``data`` is a list with one uint64 array per sample (empty samples allowed).
    Use :meth:`from_csr` when the ids already are one flat array plus lengths.
    """

    def __init__(self, name: str, data: Sequence[np.ndarray]) -> None:
        for i, sample in enumerate(data):
            if not isinstance(sample, np.ndarray) or sample.dtype != np.uint64 or sample.ndim != 1:
                raise ValueError(f"IDTypeFeature {name!r}: sample {i} must be a 1-D np.uint64 "
                                 f"array, got {type(sample).__name__} "
                                 f"{getattr(sample, 'dtype', '')}")
        self.name = name
        self.lengths = np.fromiter((s.size for s in data), dtype=np.int32, count=len(data))
        self.ids = np.concatenate(data) if len(data) else np.zeros(0, np.uint64)
        self.ids = self.ids.astype(np.uint64, copy=False)

    @classmethod
    def from_csr(cls, name: str, ids: np.ndarray, lengths: np.ndarray) -> IDTypeFeature:
        """Build from flat ``ids`` (uint64) and per-sample ``lengths`` (summing to ids.size)."""
        ids, lengths = np.asarray(ids), np.asarray(lengths)
        if ids.dtype != np.uint64 or ids.ndim != 1:
            raise ValueError(f"IDTypeFeature {name!r}: ids must be 1-D np.uint64")
        if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != ids.size:
            raise ValueError(f"IDTypeFeature {name!r}: lengths must be >= 0 and sum to {ids.size}")
        self = cls.__new__(cls)
        self.name, self.ids, self.lengths = name, ids, lengths.astype(np.int32)
        return self

    @property
    def batch_size(self) -> int:
        return int(self.lengths.size)


class IDTypeFeatureWithSingleID(IDTypeFeature):
    """A categorical feature with exactly one id per sample."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        if not isinstance(data, np.ndarray) or data.dtype != np.uint64 or data.ndim != 1:
            raise ValueError(f"IDTypeFeatureWithSingleID {name!r}: data must be a 1-D np.uint64 "
                             f"array, got {type(data).__name__} {getattr(data, 'dtype', '')}")
        self.name = name
        self.ids = data
        self.lengths = np.ones(data.size, dtype=np.int32)


class NdarrayDataBase:
    """A dense array whose first dimension is the batch."""

    DEFAULT_NAME = "ndarray_base"

    def __init__(self, data: np.ndarray, name: Optional[str] = None) -> None:
        if not isinstance(data, np.ndarray):
            raise ValueError(f"{name or self.DEFAULT_NAME}: expected np.ndarray, got "
                             f"{type(data).__name__}")
        if data.dtype.type not in _NDARRAY_DTYPES:
            raise ValueError(f"{name or self.DEFAULT_NAME}: dtype {data.dtype} not supported; "
                             f"use one of {sorted(t.__name__ for t in _NDARRAY_DTYPES)}")
        if data.ndim == 0:
            raise ValueError(f"{name or self.DEFAULT_NAME}: needs at least one dimension")
        self.data = data
        self._name = name

    @property
    def name(self) -> str:
        return self._name or self.DEFAULT_NAME

    @property
    def batch_size(self) -> int:
        return int(self.data.shape[0])

    def __len__(self) -> int:
        return len(self.data)


class NonIDTypeFeature(NdarrayDataBase):
    """A dense (non-ID) feature."""

    DEFAULT_NAME = "non_id_type_feature_anonymous"


class Label(NdarrayDataBase):
    """A label."""

    DEFAULT_NAME = "label_anonymous"


class PersiaBatch:
    """One batch: ID-type features, dense features, labels and optional meta bytes."""

    def __init__(
        self,
        id_type_features: Sequence[Union[IDTypeFeature, IDTypeFeatureWithSingleID]],
        non_id_type_features: Optional[Sequence[NonIDTypeFeature]] = None,
        labels: Optional[Sequence[Label]] = None,
        batch_size: Optional[int] = None,
        requires_grad: bool = True,
        meta: Optional[bytes] = None,
    ) -> None:
        if not id_type_features:
            raise ValueError("PersiaBatch needs at least one id_type_feature")
        batch_size = batch_size or id_type_features[0].batch_size
        if not 0 < batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be in [1, {MAX_BATCH_SIZE}], got {batch_size}")
        self.batch_size = batch_size
        self.id_type_features: list[IDTypeFeature] = []
        self.non_id_type_features: list[NonIDTypeFeature] = []
        self.labels: list[Label] = []
        for f in id_type_features:
            if not isinstance(f, IDTypeFeature):
                raise ValueError(f"id_type_features must be IDTypeFeature, got {type(f).__name__}")
            self._check_size(f, "id_type_feature")
            self.id_type_features.append(f)
        for f in non_id_type_features or []:
            self.add_non_id_type_feature(f)
        for f in labels or []:
            self.add_label(f)
        if meta is not None and not isinstance(meta, bytes):
            raise ValueError(f"meta must be bytes, got {type(meta).__name__}")
        self.requires_grad = requires_grad
        self.meta = meta

    def _check_size(self, f, kind: str) -> None:
        if f.batch_size != self.batch_size:
            raise ValueError(f"{kind} {f.name!r} has batch size {f.batch_size}, expected "
                             f"{self.batch_size}")

    def add_non_id_type_feature(self, feature: Union[NonIDTypeFeature, np.ndarray]) -> None:
        if isinstance(feature, np.ndarray):
            feature = NonIDTypeFeature(feature)
        self._check_size(feature, "non_id_type_feature")
        self.non_id_type_features.append(feature)

    def add_label(self, label: Union[Label, np.ndarray]) -> None:
        if isinstance(label, np.ndarray):
            label = Label(label)
        self._check_size(label, "label")
        self.labels.append(label)

    def id_features(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(slot, ids, lengths)`` per ID-type feature."""
        return [(f.name, f.ids, f.lengths) for f in self.id_type_features]
