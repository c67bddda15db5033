"""The NN worker's device: ``cuda:LOCAL_RANK`` where CUDA is available, an explicit
``device_id`` wins, the CPU otherwise; impossible choices name what to change. Decided by
a pure function of the CUDA state, checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from persia_py.dense.device import device_of_this_process, pick_device


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_cuda_local_rank_is_picked_when_cuda_is_available(local_rank: int) -> None:
    device = pick_device(None, local_rank=local_rank, cuda_available=True, num_cuda_devices=8)
    assert device == torch.device("cuda", local_rank)


def test_cpu_without_cuda_and_an_explicit_device_id_wins() -> None:
    assert pick_device(None, local_rank=5, cuda_available=False,
                       num_cuda_devices=0) == torch.device("cpu")
    assert pick_device(2, local_rank=5, cuda_available=True,
                       num_cuda_devices=8) == torch.device("cuda", 2)


def test_impossible_choices_say_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4 but this machine has 4 visible CUDA "
                                         r"device\(s\): start at most one NN-worker rank per "
                                         r"GPU \(--nproc-per-node 4\)"):
        pick_device(None, local_rank=4, cuda_available=True, num_cuda_devices=4)
    with pytest.raises(ValueError, match=r"device_id=1: CUDA is not available .* pass "
                                         r"device_id=None to run on the CPU"):
        pick_device(1, local_rank=0, cuda_available=False, num_cuda_devices=0)
    with pytest.raises(ValueError, match=r"device_id=3: this machine has 2 visible CUDA"):
        pick_device(3, local_rank=0, cuda_available=True, num_cuda_devices=2)
    with pytest.raises(TypeError, match=r"device_id: expected a CUDA device index"):
        pick_device(-1, local_rank=0, cuda_available=True, num_cuda_devices=2)


def test_this_process_gets_what_its_cuda_state_says() -> None:
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert device_of_this_process(None, local_rank=0) == expected


def _train_ctx(**kwargs):
    """A TrainCtx made, not entered: the device is chosen when it is made."""
    from persia_py.config import GlobalConfig
    from persia_py.ctx import TrainCtx
    from persia_py.embedding.optim import SGD
    from persia_py.env import PersiaEnv

    model = torch.nn.Linear(2, 1)
    return TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    global_config=GlobalConfig(), env=PersiaEnv(local_rank=3), **kwargs)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """torch reports 4 CUDA devices; ``set_device`` calls are recorded, not made."""
    made_current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_train_ctx_takes_cuda_local_rank_and_makes_it_current(four_gpus) -> None:
    # The whole path TrainCtx takes (environment -> pick_device -> set_device), not only
    # the pure function: a context that passed the wrong rank would still pass the above.
    ctx = _train_ctx()
    assert ctx.device == torch.device("cuda", 3)
    assert four_gpus == [torch.device("cuda", 3)]


def test_train_ctx_explicit_device_id_wins_over_local_rank(four_gpus) -> None:
    ctx = _train_ctx(device_id=1)
    assert ctx.device == torch.device("cuda", 1)
    assert four_gpus == [torch.device("cuda", 1)]
