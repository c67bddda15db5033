"""Strict configs: each class of error names the file and the key path."""

from __future__ import annotations

import pytest
from conftest import EXAMPLE

from persia_py.config import ConfigError, load_embedding_config, load_global_config


def test_example_configs_load() -> None:
    emb = load_embedding_config(EXAMPLE / "embedding_config.yml")
    assert len(emb.slots_config) == 26 and emb.slots_config["C1"].dim == 16
    glob = load_global_config(EXAMPLE / "global_config.yml")
    assert glob.embedding_parameter_server_config.num_hashmap_internal_shards == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("slots_config:\n  a:\n    dimm: 8\n", "slots_config.a.dimm: unknown key"),
        ("slots_config:\n  a:\n    dimm: 8\n", "did you mean 'dim'?"),
        ("slots_config:\n  a:\n    dim: eight\n", "slots_config.a.dim: expected int, got 'eight'"),
        ("slots_config:\n  a:\n    dim: 0\n", "slots_config.a.dim: 0 is out of range"),
        ("slots_config:\n  a:\n    embedding_summation: true\n",
         "slots_config.a.dim: required key is missing"),
        ("slots_config: {a: {dim: 4}}\nfeature_groups: {g: [b]}\n",
         "feature_groups.g: unknown slot 'b'"),
        ("slots_config: [\n", "not valid YAML"),
    ],
)
def test_embedding_config_errors(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "embedding_config.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_embedding_config(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_global_config_errors(tmp_path) -> None:
    path = tmp_path / "global_config.yml"
    path.write_text("embedding_parameter_server_config:\n  capacty: 10\n")
    with pytest.raises(ConfigError, match="capacty: unknown key.*did you mean 'capacity'"):
        load_global_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_global_config(tmp_path / "missing.yml")
