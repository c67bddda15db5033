"""The NN ranks' exchanges without pickle (``persia_py.dense.collectives``): JSON, bytes and
tensors between two gloo ranks, and bounds refused on every rank alike before anything is
allocated, after which the group still works."""

from __future__ import annotations

import pytest
from child_processes import run_ranks

pytestmark = pytest.mark.processes


def _exchanges(rank: int, _port: int, store_file: str) -> None:
    import torch
    import torch.distributed as dist

    from persia_py.dense import collectives as c

    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank,
                            world_size=2)
    try:
        # Values of different sizes, one of them empty.
        mine = {"rank": rank, "addresses": [f"10.0.0.{i}" for i in range(rank * 50)]}
        assert c.all_gather_json(mine) == [
            {"rank": r, "addresses": [f"10.0.0.{i}" for i in range(r * 50)]} for r in (0, 1)]
        assert c.all_gather_bytes(b"" if rank == 0 else b"\x00\xff") == [b"", b"\x00\xff"]
        assert c.broadcast_json({"error": "rank 1's"} if rank == 1 else None, src=1) == \
            {"error": "rank 1's"}
        # Bytes that would be a pickle are handed back as bytes, never loaded.
        assert c.broadcast_bytes(b"\x80\x04cos\nsystem\n." if rank == 0 else None, src=0) == \
            b"\x80\x04cos\nsystem\n."

        sent = [[torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(0, 4)],
                [torch.tensor([True, False]), torch.arange(3, dtype=torch.int64)]]
        got = c.broadcast_tensors(sent if rank == 1 else None, src=1, max_bytes=1 << 10,
                                  device=torch.device("cpu"))
        assert [[(t.dtype, t.shape) for t in part] for part in got] == \
            [[(t.dtype, t.shape) for t in part] for part in sent]
        assert all(torch.equal(a, b) for pa, pb in zip(got, sent) for a, b in zip(pa, pb))

        # Over the bound: the same error on both ranks, nothing allocated for it.
        with pytest.raises(ValueError, match=r"rank 1 sends 200 bytes, over the bound of 100"):
            c.all_gather_bytes(bytes(200 if rank == 1 else 10), max_bytes=100)
        with pytest.raises(ValueError, match=r"rank 0 sends \d+ bytes, over the bound of 50"):
            c.broadcast_json("x" * 100 if rank == 0 else None, src=0, max_bytes=50)
        with pytest.raises(ValueError, match=r"1 tensors of 4000 bytes, over the bound"):
            c.broadcast_tensors([[torch.zeros(1000)]] if rank == 0 else None, src=0,
                                max_bytes=1000, device=torch.device("cpu"))
        with pytest.raises(ValueError, match="is not \\[dtype, shape\\]"):
            c.broadcast_tensors([[torch.zeros(2, dtype=torch.complex64)]] if rank == 0
                                else None, src=0, max_bytes=1000, device=torch.device("cpu"))
        # ... and the ranks are still in step.
        assert c.all_gather_json(rank) == [0, 1]
    finally:
        dist.destroy_process_group()


def test_json_bytes_and_tensors_cross_ranks_without_pickle_within_bounds(tmp_path) -> None:
    run_ranks(_exchanges, str(tmp_path / "store"), timeout=120)


def test_one_rank_exchanges_with_itself_within_the_bound() -> None:
    import torch

    from persia_py.dense import collectives as c

    assert c.all_gather_json({"a": [1]}) == [{"a": [1]}]
    assert c.broadcast_json("x", src=0) == "x"
    got = c.broadcast_tensors([[torch.ones(2)]], src=0, max_bytes=8, device=torch.device("cpu"))
    assert torch.equal(got[0][0], torch.ones(2))
    with pytest.raises(ValueError, match="rank 0 sends 9 bytes, over the bound of 8"):
        c.all_gather_bytes(bytes(9), max_bytes=8)
