"""Tensor parallelism on the MoE layer (models/common/moe_tp.py): over 2 gloo ranks, an MoE split
by its experts' hidden dimension computes what the whole layer computes in one process, forward
and backward (output, input gradient, every weight's gradient), and refuses what it cannot split."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from weft.models.common.moe import MoE
from weft.models.common.moe_tp import moe_tp_plan
from weft.parallelisms.common import TransformError

from tests.support.dist_utils import run_distributed

DIM, HIDDEN, EXPERTS, TOP_K, SEQ = 16, 32, 4, 2, 12


class Holder(nn.Module):
    """The plan addresses the layer by path, as a model's plan does."""

    def __init__(self):
        super().__init__()
        self.moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=HIDDEN)


def split_and_whole() -> tuple[dict, dict]:
    """Worker: (this rank's sequence half of the split layer's output and input gradient plus the
    full weight gradients, the same from the whole layer on the whole sequence)."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    whole = Holder()
    for param in whole.parameters():
        nn.init.normal_(param, std=0.3)
    split = Holder()
    split.load_state_dict(whole.state_dict())
    parallelize_module(split, init_device_mesh("cpu", (2,)), moe_tp_plan("moe", split.moe))
    x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(2))
    mine = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    results = []
    for model, inputs, incoming in ((split, x[:, mine], grad[:, mine]), (whole, x, grad)):
        inputs = inputs.clone().requires_grad_()
        out = model.moe(inputs)
        out.backward(incoming)
        grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for name, p in model.named_parameters()}
        results.append({"out": out.detach(), "x.grad": inputs.grad, **grads})
    results[1]["out"], results[1]["x.grad"] = results[1]["out"][:, mine], results[1]["x.grad"][:, mine]
    return [{name: t.tolist() for name, t in r.items()} for r in results]  # (tensors would travel as shared memory)


def test_the_hidden_split_moe_equals_the_whole_layer_forward_and_backward():
    for split, whole in run_distributed(split_and_whole, 2):
        assert set(split) == set(whole) and len(whole) == 2 + 1 + 3 + 3  # out, x grad, router, experts, shared
        for name in whole:
            torch.testing.assert_close(torch.tensor(split[name]), torch.tensor(whole[name]), rtol=1e-5, atol=1e-6,
                                       msg=name)


def test_weighing_the_experts_outputs_cannot_be_split_by_hidden_dimension():
    layer = MoE(DIM, HIDDEN, EXPERTS, TOP_K, score_before_experts=False)
    with pytest.raises(TransformError, match="score_before_experts"):
        moe_tp_plan("moe", layer)
