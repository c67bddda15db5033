"""The NN worker's device: ``cuda:LOCAL_RANK`` where CUDA is available, an explicit
``device_id`` wins, the CPU otherwise; impossible choices name what to change. Decided by
a pure function of the CUDA state, checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from persia_py.device import device_of_this_process, pick_device


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
