"""The extension points: optimizers and row storage types are each looked up by name in
one registry, which refuses a name it does not hold by listing the ones it does, and
every registered entry round-trips through its config."""

from __future__ import annotations

import dataclasses
from typing import get_args

import numpy as np
import pytest

from persia_py.config import EmbeddingTablesConfig, RowDtype, SlotConfig
from persia_py.config.optimizer import OPTIMIZER_TYPES, optimizer_from_dict, optimizer_schema
from persia_py.config.registry import Registry
from persia_py.servers import optimizers, row_types
from persia_py.servers.optimizers import (
    OPTIMIZERS,
    apply_update,
    initial_state,
    optimizer_to_dict,
    state_width,
    step_kernel,
)
from persia_py.servers.row_step import RowStep
from persia_py.servers.storage import EmbeddingTable

KNOWN_OPTIMIZERS = ["sgd", "adagrad", "adam"]
KNOWN_ROW_TYPES = ["float32", "float16", "bfloat16"]


def _sample(schema: type):
    """An instance of every registered schema (SGD's ``lr`` has no default)."""
    return schema(lr=0.05)


def test_registry_refuses_unknown_and_taken_names() -> None:
    registry: Registry[int] = Registry("thing")
    registry.register("one", 1)
    assert registry["one"] == 1 and "one" in registry and list(registry) == ["one"]
    for unknown in ("two", None, ["one"]):
        with pytest.raises(ValueError, match=r"thing: expected one of \['one'\], got"):
            registry[unknown]
        assert unknown not in registry
    with pytest.raises(ValueError, match="'one' is registered already"):
        registry.register("one", 2)


def test_unknown_optimizer_names_and_types_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"\['adagrad', 'adam', 'sgd'\].*rmsprop"):
        optimizer_from_dict({"type": "rmsprop", "lr": 0.1})
    with pytest.raises(ValueError, match=r"\['sgd', 'adagrad', 'adam'\], got 'rmsprop'"):
        OPTIMIZERS["rmsprop"]
    not_a_config = {"type": "sgd", "lr": 0.1}
    for use in (lambda: state_width(not_a_config, 4), lambda: initial_state(not_a_config, 1, 4),
                lambda: step_kernel(not_a_config, None),
                lambda: apply_update(not_a_config, np.zeros((1, 4)), np.zeros((1, 0)),
                                     np.zeros((1, 4)))):
        with pytest.raises(ValueError, match="SGDConfig.*AdagradConfig.*AdamConfig"):
            use()


@pytest.fixture
def schema_without_rule(monkeypatch):
    """An optimizer whose schema is registered and its servers' rule is not: what adding
    one in config alone gives. Both registries are restored after the test."""
    monkeypatch.setattr(OPTIMIZER_TYPES, "_entries", dict(OPTIMIZER_TYPES._entries))
    monkeypatch.setattr(OPTIMIZERS, "_entries", dict(OPTIMIZERS._entries))

    @optimizer_schema("rmsprop")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RMSPropConfig:
        lr: float = 0.01
        weight_decay: float = 0.0
        alpha: float = 0.99

    return RMSPropConfig


def test_an_optimizer_the_servers_have_no_rule_for_is_refused_not_run_as_adam(
        schema_without_rule) -> None:
    """Before the registry, the servers' if-chains ended in Adam: such an optimizer got
    Adam's state layout and Adam's step without a word."""
    cfg = schema_without_rule(lr=0.1)
    assert optimizer_from_dict(optimizer_to_dict(cfg)) == cfg  # the config side knows it
    refused = r"'rmsprop' has a schema but no rule.*\['sgd', 'adagrad', 'adam'\]"
    with pytest.raises(ValueError, match=refused):
        state_width(cfg, 4)
    with pytest.raises(ValueError, match=refused):
        initial_state(cfg, 1, 4)
    with pytest.raises(ValueError, match=refused):
        apply_update(cfg, np.zeros((1, 4)), np.zeros((1, 9)), np.ones((1, 4)))
    with pytest.raises(ValueError, match=refused):
        RowStep(cfg, weight_bound=None, seed=0, stochastic_rounding=False)
    with pytest.raises(ValueError, match=refused):
        EmbeddingTable(dim=4, optimizer=cfg)


def test_a_rule_must_name_its_registered_schema(schema_without_rule) -> None:
    sgd = OPTIMIZERS["sgd"]
    with pytest.raises(ValueError, match="schema is RMSPropConfig, the rule's SGDConfig"):
        optimizers.register_optimizer("rmsprop", sgd)
    with pytest.raises(ValueError, match=r"optimizer: expected one of .*'nadam'"):
        optimizers.register_optimizer("nadam", sgd)


def test_every_optimizer_has_a_schema_and_a_rule_under_one_name() -> None:
    assert OPTIMIZER_TYPES.names() == OPTIMIZERS.names() == KNOWN_OPTIMIZERS
    for name, rule in OPTIMIZERS.items():
        assert OPTIMIZER_TYPES[name] is rule.schema


@pytest.mark.parametrize("name", KNOWN_OPTIMIZERS)
def test_every_optimizer_round_trips_through_its_config_and_steps(name) -> None:
    cfg = _sample(OPTIMIZER_TYPES[name])
    as_dict = optimizer_to_dict(cfg)
    assert as_dict["type"] == name and optimizer_from_dict(as_dict) == cfg
    assert SlotConfig(dim=4, optimizer=as_dict).optimizer == as_dict  # a config file's slot
    # The table applies it as its numpy reference says.
    table = EmbeddingTable(dim=4, optimizer=optimizer_from_dict(as_dict), init_lower=0.5,
                           init_upper=0.5)
    ids = np.array([7, 9], np.uint64)
    weights = table.lookup(ids, True)
    grads = np.array([[1.0, -2.0, 0.5, 0.0], [0.25, 0.0, -1.0, 3.0]], np.float32)
    table.update(ids, grads)
    expected, _ = apply_update(cfg, weights, initial_state(cfg, 2, 4), grads)
    np.testing.assert_allclose(table.lookup(ids, False), expected, rtol=1e-6)
    assert table.export_rows()["state"].shape == (2, state_width(cfg, 4))


def test_unknown_row_types_are_refused_naming_the_known_ones() -> None:
    listed = r"row_dtype: expected one of \['float32', 'float16', 'bfloat16'\], got 'float8'"
    for use in (lambda: row_types.row_type("float8"), lambda: row_types.numpy_dtype("float8"),
                lambda: row_types.bytes_per_weight("float8"),
                lambda: row_types.check_row_dtype("float8"),
                lambda: row_types.all_finite(np.zeros((1, 2), np.uint16), "float8"),
                lambda: row_types.to_stored(np.zeros((1, 2), np.float32), "float8"),
                lambda: EmbeddingTable(dim=2, optimizer=_sample(OPTIMIZER_TYPES["sgd"]),
                                       row_dtype="float8")):
        with pytest.raises(ValueError, match=listed):
            use()


def test_every_row_type_is_named_by_the_config_files() -> None:
    assert row_types.ROW_TYPES.names() == KNOWN_ROW_TYPES
    assert list(get_args(RowDtype)) == row_types.ROW_TYPES.names()


@pytest.mark.parametrize("name", KNOWN_ROW_TYPES)
def test_every_row_type_round_trips_through_its_config_and_stores_rows(name) -> None:
    config = EmbeddingTablesConfig(slots_config={"a": SlotConfig(dim=2, row_dtype=name),
                                                 "b": SlotConfig(dim=2)}, row_dtype=name)
    assert config.row_dtype_of("a") == config.row_dtype_of("b") == name
    kind = row_types.row_type(name)
    values = np.array([[1.0, -2.5], [0.125, 3.0]], np.float32)
    stored = row_types.to_stored(values, name)
    assert stored.dtype == kind.storage and row_types.bytes_per_weight(name) == stored.itemsize
    np.testing.assert_array_equal(row_types.to_float32(stored, name), values)
    assert row_types.all_finite(stored, name)
    table = EmbeddingTable(dim=2, optimizer=_sample(OPTIMIZER_TYPES["sgd"]), row_dtype=name)
    table.import_rows(np.array([1, 2], np.uint64), stored, np.zeros((2, 0), np.float32),
                      row_dtype=name)
    np.testing.assert_array_equal(table.lookup(np.array([1, 2], np.uint64), False), values)
    half = table.lookup(np.array([1, 2], np.uint64), False, dtype=np.float16) if (
        kind.answers_float16) else None
    if half is not None:
        np.testing.assert_array_equal(half, values.astype(np.float16))
