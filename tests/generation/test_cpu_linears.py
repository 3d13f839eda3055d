"""weights_first_linears: the same outputs as nn.Linear (another order of summation), only inside."""

import pytest
import torch
from torch import nn

from weft.generation.cpu_linears import MAX_ROWS, weights_first_linears


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 48), nn.Linear(48, 16, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("shape", [(1, 32), (4, 32), (2, 3, 32), (MAX_ROWS + 1, 32)])
def test_outputs_equal_nn_linear_and_forward_is_restored(shape):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(*shape)
    want = net(x)
    calls = []
    net.a.register_forward_hook(lambda *_: calls.append(1))  # module hooks still run
    with weights_first_linears(net):
        assert "forward" in vars(net.a) and "forward" in vars(net.b)
        got = net(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32 sums of 32 and 48 products
    assert calls == [1] and "forward" not in vars(net.a) and "forward" not in vars(net.b)


def test_subclasses_and_patched_linears_keep_their_own_forward():
    class Scaled(nn.Linear):
        pass

    own, sub = nn.Linear(4, 4), Scaled(4, 4)
    marker = own.forward = lambda x: x  # another patch came first
    with weights_first_linears(nn.Sequential(own, sub)):
        assert own.forward is marker and "forward" not in vars(sub)
    assert own.forward is marker
