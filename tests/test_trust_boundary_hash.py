"""Hash flooding, black-box: a parameter-server process started as users start it, sent ids
crafted to collide under the public hashes the server used before keying, keeps answering
with the right rows (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import start_server

from persia_py.config import CommonConfig
from persia_py.hashing import HASH_STACK_SALT, inverse_mix64
from persia_py.servers.initializer import initial_rows
from persia_py.workers.ps_client import PSClient, configure_request

pytestmark = pytest.mark.processes

DIM = 4
SEED = 11
COMMON = CommonConfig(rpc_timeout_sec=120, startup_timeout_sec=60)
EMBEDDING_CONFIG = f"""
slots_config:
  user:
    dim: {DIM}
"""


def _colliding(count: int, salt: int, first: int = 1) -> np.ndarray:
    """Ids whose public ``mix64(id, salt)`` share their low 20 bits (one home slot)."""
    hashed = np.arange(first, first + count, dtype=np.uint64) << np.uint64(20)
    return inverse_mix64(hashed, salt)


@pytest.fixture
def server(tmp_path):
    config = tmp_path / "embedding_config.yml"
    config.write_text(EMBEDDING_CONFIG)
    proc, port = start_server("embedding-parameter-server", "--embedding-config", str(config),
                              "--replica-index", "0", "--replica-size", "1")
    client = PSClient(f"127.0.0.1:{port}", COMMON)
    try:
        client.configure(configure_request({"type": "sgd", "lr": 0.1}, init_lower=-0.5,
                                           init_upper=0.5, weight_bound=None, seed=SEED))
        yield client
    finally:
        client.close()
        proc.stop()


def _expected(ids: np.ndarray) -> np.ndarray:
    return initial_rows(ids, DIM, -0.5, 0.5, SEED)


def test_flood_of_old_hash_collisions_is_stored_and_served_right(server) -> None:
    index_flood = _colliding(40_000, HASH_STACK_SALT)  # the old index hash
    dedup_flood = _colliding(20_000, 0)  # the old dedup hash (plain splitmix64)
    honest = np.random.default_rng(0).integers(1, 2**63, 2000, dtype=np.uint64)
    for ids in (index_flood, np.repeat(dedup_flood, 2), honest):
        np.testing.assert_array_equal(server.lookup([("user", ids)], training=True)[0],
                                      _expected(ids))
    # Everything is stored once and reads back the same, flooded ids and honest ones alike;
    # ids never inserted still read as zeros.
    everything = np.concatenate([honest, index_flood[::-1], dedup_flood])
    np.testing.assert_array_equal(server.lookup([("user", everything)], training=False)[0],
                                  _expected(everything))
    absent = _colliding(1000, HASH_STACK_SALT, first=50_000)
    assert not server.lookup([("user", absent)], training=False)[0].any()
    (table,) = server.stats().tables
    assert table.entries == index_flood.size + dedup_flood.size + honest.size
    assert table.evicted == 0
