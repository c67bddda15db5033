"""Failures of the NN ranks' collectives are told apart from other errors and name the
peers (``persia_py.dense.process_group``)."""

from __future__ import annotations

import pytest

from persia_py.config import CommonConfig
from persia_py.dense.process_group import PeerFailure, is_collective_failure, naming_peers


def _raised_here(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)  # raised outside c10d, as DDP's autograd hooks raise it
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize("message", [
    "Application timeout caused pair closure",  # gloo's own timeout of a pair: no path
    "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:1",
    "Connection reset by peer",
])
def test_gloo_transport_failures_are_collective_failures(message: str) -> None:
    assert is_collective_failure(_raised_here(message))


def test_other_runtime_errors_are_not() -> None:
    assert not is_collective_failure(_raised_here("mat1 and mat2 shapes cannot be multiplied"))


def test_a_pair_timeout_in_backward_names_every_other_rank() -> None:
    with pytest.raises(PeerFailure, match=r"the dense gradients' allreduce failed on rank 0: "
                       r"a peer NN-worker rank is unreachable or stalled \(rank 1 at "
                       r"10\.0\.0\.3:1234\)"):
        with naming_peers("the dense gradients' allreduce", ["10.0.0.2:1234", "10.0.0.3:1234"],
                          0, CommonConfig()):
            raise RuntimeError("Application timeout caused pair closure")
