"""bench/tensor_bytes.py: each byte of the training state once, under its first kind; each storage
saved for backward once, parameters and checkpoint recomputation left out."""

import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from critic_adapters.bench.tensor_bytes import DevicePeak, SavedForBackward, state_bytes
from critic_adapters.common.tests.helpers import run_pytest


def _engine(**tensors):
    return types.SimpleNamespace(_offload_tensors=lambda: tensors)


def test_state_bytes_counts_each_byte_once_under_its_first_kind():
    buffer = torch.zeros(100)  # a contiguous parameter buffer with 10 elements of slack at its end
    params = [buffer[:40].view(4, 10), buffer[40:90]]
    shard = buffer[20:70]  # an optimizer's main-parameter shard: a view of the same buffer
    grads = torch.zeros(100)
    state = [torch.zeros(4, 10), torch.zeros(50), torch.zeros(())]
    held = state_bytes(_engine(model=params, grads=[grads[:40], grads[40:90], grads[:40]],
                               optimizer=[*params, shard, *state]))
    assert held == {"parameters": 4 * 90, "gradients": 4 * 90, "optimizer": 4 * 91}


def test_state_bytes_counts_offloaded_tensors_by_their_size():
    param = torch.zeros(8, 4)
    param.untyped_storage().resize_(0)  # what engine.offload() does to the device storage
    assert state_bytes(_engine(model=[param], grads=[], optimizer=[]))["parameters"] == 4 * 32


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "non-reentrant", "reentrant"])
def test_saved_for_backward_counts_the_forwards_activations_without_parameters(reentrant):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    x = torch.randn(16, 8, requires_grad=True)
    with SavedForBackward(model) as saved:
        if reentrant is None:
            out = model(x)
        else:
            out = x
            for block in model:
                out = checkpoint(block, out, use_reentrant=reentrant)
        out.square().sum().backward()
    assert saved.live == 0  # the backward freed all of it
    if reentrant is None:
        # per block: its input (up saves it) and relu's output (relu and down save it: one storage), 16 x (8 + 32)
        # floats; then square's input (16 x 8); the weights not at all.
        assert saved.peak == 2 * 4 * 16 * 40 + 4 * 16 * 8
    else:
        assert saved.peak == 2 * 4 * 16 * 8 + 4 * 16 * 8  # each block's input, square's input


def test_saved_for_backward_counts_a_storage_once_for_its_views():
    weight = torch.randn(64, requires_grad=True)
    with SavedForBackward(torch.nn.Module()) as saved:
        base = weight * 2
        left, right = base[:32], base[32:]
        (left * right).sum().backward()
    assert saved.peak == 4 * 64


def test_device_peak_is_none_off_cuda():
    with DevicePeak() as device:
        torch.zeros(10)
    assert (device.peak is None) == (not (torch.cuda.is_available() and torch.cuda.is_initialized()))


if __name__ == "__main__":
    run_pytest(__file__)
