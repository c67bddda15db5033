"""Strict configs: each class of error names the file and the key path; one rule per
table setting, shared by the config file, the user API and the servers."""

from __future__ import annotations

import numpy as np
import pytest
from checkout import EXAMPLE

from persia_py.config import (
    ConfigError,
    GlobalConfig,
    SlotConfig,
    embedding_config_from_dict,
    load_embedding_config,
    load_global_config,
)
from persia_py.config.optimizer import SGDConfig
from persia_py.embedding import EmbeddingConfig
from persia_py.servers.parameter_server import ParameterServer
from persia_py.servers.storage import EmbeddingTable


def test_example_configs_load() -> None:
    emb = load_embedding_config(EXAMPLE / "embedding_config.yml")
    assert len(emb.slots_config) == 26 and emb.slots_config["C1"].dim == 16
    glob = load_global_config(EXAMPLE / "global_config.yml")
    assert glob.embedding_parameter_server_config.num_hashmap_internal_shards == 2


@pytest.mark.parametrize(
    "text, message",
    [  # the other classes of error: test_config_messages.py
        ("slots_config: {a: {dim: 4}}\nfeature_groups: {g: [b]}\n",
         "feature_groups.g: unknown slot 'b'"),
        ("slots_config: [\n", "not valid YAML"),
        ("slots_config: {a: {dim: 4, optimizer: {type: sgd, lr: -1}}}\n",
         "slots_config.a.optimizer: lr: -1 is out of range"),
        ("slots_config: {a: {dim: 4, admit_probability: 0}}\n",
         "slots_config.a.admit_probability: 0.0 is out of range; expected 0.0 < "
         "admit_probability <= 1.0"),
    ],
)
def test_embedding_config_errors(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "embedding_config.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert str(path) in str(info.value) and message in str(info.value)


POLICIES = [("capacity", 0), ("capacity", 2**63), ("capacity", 5), ("admit_probability", 0.0),
            ("admit_probability", 1.5), ("admit_probability", 0.25), ("min_occurrences", 0),
            ("min_occurrences", 256), ("min_occurrences", 255), ("expire_after_steps", 0),
            ("expire_after_steps", 7), ("expire_after_seconds", -1.0),
            ("expire_after_seconds", float("inf")), ("expire_after_seconds", 0.5)]


def _outcome(make) -> str:
    try:
        table = make()
    except ValueError as exc:
        return f"refused: {exc}"
    if isinstance(table, EmbeddingTable):
        table.close()
    return "accepted"


@pytest.mark.parametrize(("field", "value"), POLICIES)
def test_config_file_and_table_apply_one_policy_rule(field: str, value) -> None:
    """slots_config.<slot> and the parameter server's table accept and refuse alike,
    with the same message."""
    in_config = _outcome(lambda: SlotConfig(dim=4, **{field: value}))
    in_table = _outcome(lambda: EmbeddingTable(dim=4, optimizer=SGDConfig(lr=0.1),
                                               **{field: value}))
    assert in_config == in_table
    assert in_config == "accepted" or field in in_config


@pytest.mark.parametrize("bounds", [(-0.1, 0.1), (0.0, 0.0), (0.1, -0.1), (float("nan"), 1.0),
                                    (0.0, float("inf"))])
def test_initialization_bounds_have_one_rule(bounds) -> None:
    """The user's EmbeddingConfig, the parameter server's configure and the table agree
    (equal bounds: a constant fill)."""
    user = _outcome(lambda: EmbeddingConfig(emb_initialization=bounds))
    server = _outcome(lambda: ParameterServer(GlobalConfig(), embedding_config_from_dict(
        {"slots_config": {"a": {"dim": 4}}})).configure(
            optimizer={"type": "sgd", "lr": 0.1}, init_lower=bounds[0], init_upper=bounds[1]))
    table = _outcome(lambda: EmbeddingTable(dim=4, optimizer=SGDConfig(lr=0.1),
                                            init_lower=bounds[0], init_upper=bounds[1]))
    outcomes = {o.split(":")[0] for o in (user, server, table)}
    assert len(outcomes) == 1, (user, server, table)
    assert (outcomes == {"accepted"}) == (bounds[0] <= bounds[1] and np.isfinite(bounds).all())


def test_the_parsed_file_and_the_user_settings_have_their_own_names() -> None:
    import persia_py.config as config

    assert not hasattr(config, "EmbeddingConfig")
    assert load_embedding_config(EXAMPLE / "embedding_config.yml").__class__ is (
        config.EmbeddingTablesConfig)
    assert EmbeddingConfig().emb_initialization == (-0.01, 0.01)


def test_global_config_errors(tmp_path) -> None:
    path = tmp_path / "global_config.yml"
    path.write_text("embedding_parameter_server_config:\n  capacty: 10\n")
    with pytest.raises(ConfigError, match="capacty: unknown key.*did you mean 'capacity'"):
        load_global_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_global_config(tmp_path / "missing.yml")


def test_fsdp_bound_in_the_config_is_a_positive_int_or_null(tmp_path) -> None:
    """``nn_worker_config.fsdp_max_unsharded_bytes``: unset and null give no bound; a
    positive int is read; anything else names the key."""
    path = tmp_path / "global_config.yml"
    assert load_global_config(None).nn_worker_config.fsdp_max_unsharded_bytes is None
    for text, bound in [("{}", None), ("{fsdp_max_unsharded_bytes: null}", None),
                        ("{fsdp_max_unsharded_bytes: 1048576}", 1 << 20)]:
        path.write_text(f"nn_worker_config: {text}\n")
        assert load_global_config(path).nn_worker_config.fsdp_max_unsharded_bytes == bound
    for value, message in [("0", "0 is out of range"), ("-5", "-5 is out of range"),
                           ("1500000.0", "expected int or NoneType, got 1500000.0"),
                           ("true", "expected int or NoneType, got True"),
                           ("lots", "expected int or NoneType, got 'lots'")]:
        path.write_text(f"nn_worker_config: {{fsdp_max_unsharded_bytes: {value}}}\n")
        with pytest.raises(ConfigError) as info:
            load_global_config(path)
        assert f"nn_worker_config.fsdp_max_unsharded_bytes: {message}" in str(info.value)
