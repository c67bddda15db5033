"""Batch data types (as PERSIA's ``persia.embedding.data``).

ID-type features are stored in CSR form (flat uint64 ids and per-sample lengths), which
is what travels on the wire. Every check raises ``ValueError`` naming the feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

from persia_py.config.checks import check_type
from persia_py.ids import as_ids

__all__ = [
    "IDTypeFeature", "IDTypeFeatureWithSingleID", "Label", "NdarrayDataBase",
    "NonIDTypeFeature", "PersiaBatch",
]

MAX_BATCH_SIZE = 1 << 24

_NDARRAY_DTYPES = frozenset(
    [np.bool_, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint8]
)


class IDTypeFeature:
    """A categorical feature with a variable number of ids per sample (LIL form).

    ``data`` is a list with one 1-D integer array per sample (empty samples allowed):
    numpy uint64 or int64 (or any integer dtype), or a torch integer tensor; negative ids
    are refused (see :func:`persia_py.ids.as_ids`; strings go through
    :func:`persia_py.ids.hash_values` first). Use :meth:`from_csr` when the ids already
    are one flat array plus lengths.
    """

    def __init__(self, name: str, data: Sequence[np.ndarray]) -> None:
        check_type("IDTypeFeature(name=...)", name, str, "the slot's name, a str")
        check_type(f"IDTypeFeature({name!r}, data=...)", data, (list, tuple),
                   "a list with one 1-D id array per sample (ids of one per sample: "
                   "IDTypeFeatureWithSingleID; flat ids and lengths: IDTypeFeature.from_csr)")
        for i, sample in enumerate(data):
            if not (hasattr(sample, "ndim") and sample.ndim == 1):
                raise ValueError(f"IDTypeFeature {name!r}: sample {i} must be a 1-D integer "
                                 f"array (np.uint64 or np.int64, or a torch tensor), got "
                                 f"{type(sample).__name__} {getattr(sample, 'dtype', '')}")
        self.name = name
        self.lengths = np.fromiter((s.shape[0] for s in data), dtype=np.int32, count=len(data))
        if all(isinstance(s, np.ndarray) and s.dtype == np.uint64 for s in data):
            ids = np.concatenate(data) if len(data) else np.zeros(0, np.uint64)
        else:  # converted one by one: numpy concatenates int64 with uint64 into float64
            ids = np.concatenate([as_ids(s, feature=name) for s in data])
        self.ids = as_ids(ids, feature=name)

    @classmethod
    def from_csr(cls, name: str, ids: np.ndarray, lengths: np.ndarray) -> IDTypeFeature:
        """Build from flat ``ids`` (1-D integers as :func:`persia_py.ids.as_ids` takes
        them: uint64, int64 >= 0, numpy or torch) and per-sample ``lengths`` (summing to
        ids.size)."""
        ids, lengths = as_ids(ids, feature=name), np.asarray(lengths)
        if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != ids.size:
            raise ValueError(f"IDTypeFeature {name!r}: lengths must be >= 0 and sum to {ids.size}")
        self = cls.__new__(cls)
        self.name, self.ids, self.lengths = name, ids, lengths.astype(np.int32)
        return self

    @property
    def batch_size(self) -> int:
        return int(self.lengths.size)


class IDTypeFeatureWithSingleID(IDTypeFeature):
    """A categorical feature with exactly one id per sample: ``data`` is 1-D integers as
    :func:`persia_py.ids.as_ids` takes them (uint64, int64 >= 0, numpy or torch)."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        check_type("IDTypeFeatureWithSingleID(name=...)", name, str, "the slot's name, a str")
        data = as_ids(data, feature=name)
        self.name = name
        self.ids = data
        self.lengths = np.ones(data.size, dtype=np.int32)


class NdarrayDataBase:
    """A dense array whose first dimension is the batch."""

    DEFAULT_NAME = "ndarray_base"

    def __init__(self, data: np.ndarray, name: Optional[str] = None) -> None:
        check_type(f"{type(self).__name__}(data=...)", data, np.ndarray,
                   "a numpy array whose first dimension is the batch (a torch tensor: "
                   "tensor.cpu().numpy())")
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
        check_type("PersiaBatch(id_type_features=...)", id_type_features, (list, tuple),
                   "a list of IDTypeFeature or IDTypeFeatureWithSingleID")
        for i, f in enumerate(id_type_features):
            check_type(f"PersiaBatch(id_type_features=...)[{i}]", f, IDTypeFeature,
                       "an IDTypeFeature or IDTypeFeatureWithSingleID")
        for arg, value in (("non_id_type_features", non_id_type_features), ("labels", labels)):
            check_type(f"PersiaBatch({arg}=...)", value, (list, tuple), "a list or None",
                       optional=True)
        check_type("PersiaBatch(requires_grad=...)", requires_grad, (bool, np.bool_),
                   "a bool (True: a training batch; False: an evaluation batch)")
        if not id_type_features:
            raise ValueError("PersiaBatch needs at least one id_type_feature")
        batch_size = batch_size or id_type_features[0].batch_size
        if not 0 < batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be in [1, {MAX_BATCH_SIZE}], got {batch_size}")
        self.batch_size = batch_size
        self.id_type_features: list[IDTypeFeature] = []
        self.non_id_type_features: list[NonIDTypeFeature] = []
        self.labels: list[Label] = []
        for feature in id_type_features:
            self._check_size(feature, "id_type_feature")
            self.id_type_features.append(feature)
        for non_id in non_id_type_features or []:
            self.add_non_id_type_feature(non_id)
        for label in labels or []:
            self.add_label(label)
        check_type("PersiaBatch(meta=...)", meta, bytes, "bytes or None", optional=True)
        self.requires_grad = bool(requires_grad)
        self.meta = meta

    def _check_size(self, f, kind: str) -> None:
        if f.batch_size != self.batch_size:
            raise ValueError(f"{kind} {f.name!r} has batch size {f.batch_size}, expected "
                             f"{self.batch_size}")

    def add_non_id_type_feature(self, feature: Union[NonIDTypeFeature, np.ndarray]) -> None:
        check_type("non_id_type_feature", feature, (NonIDTypeFeature, np.ndarray),
                   "a NonIDTypeFeature or a numpy array")
        if isinstance(feature, np.ndarray):
            feature = NonIDTypeFeature(feature)
        self._check_size(feature, "non_id_type_feature")
        self.non_id_type_features.append(feature)

    def add_label(self, label: Union[Label, np.ndarray]) -> None:
        check_type("label", label, (Label, np.ndarray), "a Label or a numpy array")
        if isinstance(label, np.ndarray):
            label = Label(label)
        self._check_size(label, "label")
        self.labels.append(label)

    def id_features(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(slot, ids, lengths)`` per ID-type feature."""
        return [(f.name, f.ids, f.lengths) for f in self.id_type_features]
