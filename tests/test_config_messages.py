"""One test per class of config error, asserting the exact message: the file, the key
path, what was expected and, for a misspelling, the closest valid key."""

from __future__ import annotations

import dataclasses

import pytest

from persia_py.config import (
    ConfigError,
    GlobalConfig,
    SlotConfig,
    load_embedding_config,
    load_global_config,
)

CASES = [  # (file, text, message after "<path>: ")
    # unknown / misspelled key
    ("global", "embedding_parameter_server_config:\n  capacty: 10\n",
     "embedding_parameter_server_config.capacty: unknown key (valid keys here: ['capacity', "
     "'num_hashmap_internal_shards']); did you mean 'capacity'?"),
    ("global", "common_confg: {}\n",
     "common_confg: unknown key (valid keys here: {GlobalConfig}); did you mean 'common_config'?"),
    ("embedding", "slots_config:\n  a:\n    dimm: 8\n",
     "slots_config.a.dimm: unknown key (valid keys here: {SlotConfig}); did you mean 'dim'?"),
    # wrong type
    ("global", "common_config:\n  rpc_timeout_sec: soon\n",
     "common_config.rpc_timeout_sec: expected float, got 'soon'"),
    ("global", "common_config:\n  job_type: Serve\n",
     "common_config.job_type: expected 'Train' or 'Infer', got 'Serve'"),
    ("embedding", "slots_config:\n  a:\n    dim: eight\n",
     "slots_config.a.dim: expected int, got 'eight'"),
    ("embedding", "slots_config:\n  a:\n    dim: 8\n    embedding_summation: 1\n",
     "slots_config.a.embedding_summation: expected bool, got 1"),
    # out of range
    ("global", "embedding_worker_config:\n  forward_buffer_size: 0\n",
     "embedding_worker_config.forward_buffer_size: 0 is out of range; expected 1 <= "
     "forward_buffer_size <= 1000000"),
    ("embedding", "slots_config:\n  a:\n    dim: 0\n",
     "slots_config.a.dim: 0 is out of range; expected 1 <= dim <= 65536"),
    # missing required key
    ("embedding", "slots_config:\n  a:\n    sqrt_scaling: true\n",
     "slots_config.a.dim: required key is missing"),
    ("embedding", "feature_index_prefix_bit: 8\n", "slots_config: required key is missing"),
]


@pytest.mark.parametrize("which, text, message", CASES)
def test_exact_message(tmp_path, which: str, text: str, message: str) -> None:
    path = tmp_path / f"{which}_config.yml"
    path.write_text(text)
    load = load_global_config if which == "global" else load_embedding_config
    # The lists of valid keys come from the schema, which grows.
    message = message.format(**{cls.__name__: sorted(f.name for f in dataclasses.fields(cls))
                                for cls in (GlobalConfig, SlotConfig)})
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}: {message}"
