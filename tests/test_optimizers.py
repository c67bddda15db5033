"""Embedding optimizers, checked through EmbeddingTable.update against numpy references;
the user classes, the config files and the servers share one schema."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from persia_py.config import ConfigError, SlotConfig
from persia_py.config.optimizer import (
    AdagradConfig,
    AdamConfig,
    SGDConfig,
    optimizer_from_dict,
    optimizer_to_dict,
)
from persia_py.embedding.optim import SGD, Adagrad, Adam
from persia_py.servers.optimizers import apply_update, initial_state, state_width
from persia_py.servers.storage import EmbeddingTable

DIM = 6
IDS = np.array([3, 17, 42, 99, 1000], dtype=np.uint64)


def _batches(steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches with repeated ids (and one absent id in some steps)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.choice(IDS, size=9, replace=True).astype(np.uint64)
        out.append((ids, rng.normal(size=(ids.shape[0], DIM)).astype(np.float32)))
    return out


def _summed(ids: np.ndarray, grads: np.ndarray) -> dict[int, np.ndarray]:
    sums: dict[int, np.ndarray] = {}
    for i, g in zip(ids.tolist(), grads.astype(np.float64), strict=True):
        sums[i] = sums.get(i, 0.0) + g
    return sums


class _Reference:
    """Per-row float64 loop implementations of the optimizer formulas."""

    def __init__(self, cfg, weights: dict[int, np.ndarray], bound: float | None = None):
        self.cfg, self.w, self.bound = cfg, {k: v.astype(np.float64) for k, v in weights.items()}, bound
        self.state: dict[int, dict] = {}

    def step(self, ids: np.ndarray, grads: np.ndarray) -> None:
        cfg = self.cfg
        for i, g in _summed(ids, grads).items():
            w = self.w[i]
            g = g + cfg.weight_decay * w
            st = self.state.setdefault(i, {})
            if isinstance(cfg, SGDConfig):
                w = w - cfg.lr * g
            elif isinstance(cfg, AdagradConfig):
                acc = st.get("acc", np.full(1 if cfg.vectorwise_shared else DIM,
                                            cfg.initial_accumulator_value))
                g2 = np.mean(g * g) if cfg.vectorwise_shared else g * g
                acc = cfg.g_square_momentum * acc + g2
                st["acc"] = acc
                w = w - cfg.lr * g / (np.sqrt(acc) + cfg.eps)
            else:
                b1, b2 = cfg.betas
                t = st.get("t", 0) + 1
                m = b1 * st.get("m", 0.0) + (1 - b1) * g
                v = b2 * st.get("v", 0.0) + (1 - b2) * g * g
                st.update(t=t, m=m, v=v)
                w = w - cfg.lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + cfg.eps)
            if self.bound is not None:
                w = np.clip(w, -self.bound, self.bound)
            self.w[i] = w

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.stack([self.w[i] for i in ids.tolist()])


@pytest.mark.parametrize(
    "cfg",
    [
        SGDConfig(lr=0.1),
        SGDConfig(lr=0.05, weight_decay=0.3),
        AdagradConfig(lr=0.1),
        AdagradConfig(lr=0.05, weight_decay=0.1, g_square_momentum=0.9,
                      initial_accumulator_value=0.5),
        AdagradConfig(lr=0.1, vectorwise_shared=True, weight_decay=0.05),
        AdamConfig(lr=0.01),
        AdamConfig(lr=0.02, betas=(0.8, 0.95), weight_decay=0.2, eps=1e-6),
    ],
    ids=repr,
)
def test_matches_reference_over_steps(cfg) -> None:
    table = EmbeddingTable(dim=DIM, optimizer=cfg, init_lower=-0.5, init_upper=0.5, seed=7)
    start = table.lookup(IDS, True)
    ref = _Reference(cfg, dict(zip(IDS.tolist(), start, strict=True)))
    for ids, grads in _batches(6):
        assert table.update(ids, grads) == np.unique(ids).shape[0]
        ref.step(ids, grads)
        np.testing.assert_allclose(table.lookup(IDS, False), ref.rows(IDS), rtol=2e-5, atol=2e-6)


def test_weight_bound_clamps_after_update() -> None:
    cfg = SGDConfig(lr=1.0)
    table = EmbeddingTable(dim=DIM, optimizer=cfg, weight_bound=0.25)
    start = table.lookup(IDS, True)
    ref = _Reference(cfg, dict(zip(IDS.tolist(), start, strict=True)), bound=0.25)
    for ids, grads in _batches(3, seed=1):
        table.update(ids, grads)
        ref.step(ids, grads)
    got = table.lookup(IDS, False)
    assert np.abs(got).max() == pytest.approx(0.25)
    np.testing.assert_allclose(got, ref.rows(IDS), rtol=1e-6, atol=1e-7)


def test_adam_first_step_is_bias_corrected_and_per_row() -> None:
    lr = 1e-3
    table = EmbeddingTable(dim=DIM, optimizer=AdamConfig(lr=lr))
    ids = np.array([1, 2], dtype=np.uint64)
    start = table.lookup(ids, True)
    rng = np.random.default_rng(2)
    # Several steps on id 1 only: id 2's step count must stay at zero.
    for _ in range(5):
        table.update(ids[:1], rng.normal(size=(1, DIM)).astype(np.float32))
    grads = np.array([[1e-4, -3.0, 7.0, -1e-2, 0.5, 2.0]], dtype=np.float32)
    table.update(ids[1:], grads)
    delta = table.lookup(ids, False)[1] - start[1]
    # With m_hat = g and v_hat = g**2, the first step is lr * sign(g) whatever |g| is.
    np.testing.assert_allclose(delta, -lr * np.sign(grads[0]), rtol=1e-3)


def test_apply_update_is_pure() -> None:
    cfg = AdamConfig()
    w = np.ones((3, DIM), dtype=np.float32)
    s = initial_state(cfg, 3, DIM)
    g = np.full((3, DIM), 0.5, dtype=np.float32)
    w0, s0 = w.copy(), s.copy()
    new_w, new_s = apply_update(cfg, w, s, g)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(s, s0)
    assert new_w.shape == w.shape and new_s.shape == (3, state_width(cfg, DIM))


def test_state_widths() -> None:
    assert state_width(SGDConfig(lr=1.0), 8) == 0
    assert state_width(AdagradConfig(), 8) == 8
    assert state_width(AdagradConfig(vectorwise_shared=True), 8) == 1
    assert state_width(AdamConfig(), 8) == 17
    np.testing.assert_array_equal(
        initial_state(AdagradConfig(initial_accumulator_value=0.3), 2, 4),
        np.full((2, 4), 0.3, dtype=np.float32))


@pytest.mark.parametrize(
    "cfg", [SGDConfig(lr=0.5, weight_decay=0.1), AdagradConfig(vectorwise_shared=True),
            AdamConfig(betas=(0.5, 0.9))], ids=repr)
def test_dict_round_trip(cfg) -> None:
    d = optimizer_to_dict(cfg)
    assert d["type"] in {"sgd", "adagrad", "adam"}
    assert optimizer_from_dict(d) == cfg


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"type": "rmsprop", "lr": 0.1}, "sgd"),
        ({"lr": 0.1}, "type"),
        ({"type": "sgd", "lr": 0.1, "momentum": 0.9}, "momentum.*allowed.*weight_decay"),
        ({"type": "adam", "beta1": 0.9}, "beta1.*allowed.*betas"),
        ({"type": "sgd"}, "lr"),
        ({"type": "sgd", "lr": -1.0}, "lr"),
        ({"type": "sgd", "lr": "fast"}, "lr"),
        ({"type": "adagrad", "eps": 0.0}, "eps"),
        ({"type": "adagrad", "g_square_momentum": 1.5}, "g_square_momentum"),
        ({"type": "adagrad", "vectorwise_shared": 1}, "vectorwise_shared"),
        ({"type": "adam", "betas": [0.9, 1.0]}, r"betas\[1\]"),
        ({"type": "adam", "betas": [0.9]}, "betas"),
        ({"type": "adam", "weight_decay": float("nan")}, "weight_decay"),
    ],
)
def test_bad_configs_rejected(d, match) -> None:
    with pytest.raises(ValueError, match=match):
        optimizer_from_dict(d)


def test_configs_are_frozen_and_keyword_only() -> None:
    cfg = SGDConfig(lr=0.1)
    with pytest.raises(AttributeError):
        cfg.lr = 0.2  # type: ignore[misc]
    with pytest.raises(TypeError):
        SGDConfig(0.1)  # type: ignore[misc]


def test_table_rejects_non_config_optimizer() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        EmbeddingTable(dim=4, optimizer={"type": "sgd", "lr": 0.1})  # type: ignore[arg-type]


def test_user_classes_take_persia_arguments_and_the_schema_defaults() -> None:
    """PERSIA's positional order; the defaults are the schema's, declared once."""
    assert Adagrad().to_dict() == optimizer_to_dict(AdagradConfig())
    assert Adam().to_dict() == optimizer_to_dict(AdamConfig())
    assert SGD(0.5).to_dict() == optimizer_to_dict(SGDConfig(lr=0.5))
    assert Adagrad(0.1, 0.2, 0.3, 0.9, 1e-6, True).config == AdagradConfig(
        lr=0.1, initial_accumulator_value=0.2, weight_decay=0.3, g_square_momentum=0.9,
        eps=1e-6, vectorwise_shared=True)
    assert Adam(0.01, (0.8, 0.9), 0.1, 1e-6).config == AdamConfig(
        lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, eps=1e-6)
    assert optimizer_from_dict(Adam(0.01, (0.8, 0.9)).to_dict()) == Adam(0.01, (0.8, 0.9)).config


@pytest.mark.parametrize(("make", "as_dict"), [
    (lambda: SGD(lr=-1.0), {"type": "sgd", "lr": -1.0}),
    (lambda: Adagrad(eps=0.0), {"type": "adagrad", "eps": 0.0}),
    (lambda: Adam(betas=(0.9, 1.0)), {"type": "adam", "betas": [0.9, 1.0]}),
])
def test_one_rule_for_user_classes_config_files_and_servers(make, as_dict) -> None:
    """A bad value is refused at once by the user class, with the message the servers
    (and a slot's ``optimizer`` in embedding_config.yml) give for it."""
    with pytest.raises(ValueError) as user:
        make()
    with pytest.raises(ValueError) as server:
        optimizer_from_dict(as_dict)
    assert str(user.value) == str(server.value)
    with pytest.raises(ConfigError, match=f"optimizer: {re.escape(str(server.value))}"):
        SlotConfig(dim=4, optimizer=as_dict)


def test_default_adagrad_takes_torch_adagrads_steps() -> None:
    """``Adagrad(lr=...)`` on the servers steps a row as ``torch.optim.Adagrad(params,
    lr=...)`` does: the same update (the accumulator takes ``g**2`` before the step, ``eps``
    outside the root) and the same defaults. The gradients are of the size an embedding
    gets from one sample of a mean loss (1e-3): there PERSIA's initial accumulator, 0.01,
    would make every early step about ``10 * lr * |g|``, some 20x smaller than torch's."""
    lr = 0.05
    table = EmbeddingTable(dim=DIM, optimizer=Adagrad(lr=lr).config, seed=3)
    weight = torch.nn.Parameter(torch.from_numpy(table.lookup(IDS, True).copy()))
    reference = torch.optim.Adagrad([weight], lr=lr)
    row_of = {int(i): k for k, i in enumerate(IDS.tolist())}
    for ids, grads in _batches(6):
        grads *= np.float32(1e-3)
        table.update(ids, grads)
        weight.grad = torch.zeros_like(weight).index_add_(
            0, torch.tensor([row_of[int(i)] for i in ids]), torch.from_numpy(grads))
        reference.step()
        np.testing.assert_allclose(table.lookup(IDS, False), weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-8)


def test_default_adagrad_trains_as_well_as_torch_adagrad() -> None:
    """docs/online_training.md's model and optimizers on a short MovieLens-shaped stream,
    the embeddings stepped once by the servers' tables with ``Adagrad(lr=0.05)`` and once
    by ``torch.optim.Adagrad(lr=0.05)``, from the same rows: the same progressive AUC."""
    from benchmarks.embedding_optimizer import run, stream_case

    case = stream_case(num_samples=30_000)
    torch_auc, persia_auc = run(case, "torch", None), run(case, "persia", None)
    assert torch_auc > 0.6, torch_auc  # it learned: chance is 0.5
    assert abs(persia_auc - torch_auc) < 0.002, (persia_auc, torch_auc)
