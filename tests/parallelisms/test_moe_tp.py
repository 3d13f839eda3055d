"""Tensor parallelism on the MoE layer (models/common/moe_tp.py): over 2 gloo ranks, an MoE split
by its experts' hidden dimension computes what the whole layer computes in one process, forward
and backward (output, input gradient, every weight's gradient): scores before the experts (Llama 4),
after them (Qwen3-MoE), and gpt-oss's biased, clamped experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from weft.models.common.moe import ClampedSwiGLUExperts, MoE
from weft.models.common.moe_tp import moe_tp_plan

from tests.support.dist_utils import run_distributed

DIM, HIDDEN, EXPERTS, TOP_K, SEQ = 16, 32, 4, 2, 12


class Holder(nn.Module):
    """The plan addresses the layer by path, as a model's plan does."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "before":
            self.moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=HIDDEN)
        elif kind == "after":
            self.moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, score_func="softmax", score_before_experts=False)
        else:  # gpt-oss's: biases, a clamp that bites (limit 0.5 against weights of std 0.3)
            experts = ClampedSwiGLUExperts(DIM, HIDDEN, EXPERTS, limit=0.5)
            self.moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, score_func="softmax", score_before_experts=False,
                           norm_topk_prob=True, router_bias=True, experts=experts)


KINDS = {"before": 2 + 1 + 3 + 3, "after": 2 + 1 + 3, "clamped": 2 + 2 + 6}  # out, x grad; router; experts; shared


def split_and_whole() -> dict[str, tuple[dict, dict]]:
    """Worker: for each kind of layer, (this rank's sequence half of the split layer's output and
    input gradient plus the full weight gradients, the same from the whole layer on the whole sequence)."""
    return {kind: split_and_whole_of(kind) for kind in KINDS}


def split_and_whole_of(kind: str) -> tuple[dict, dict]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    whole = Holder(kind)
    for param in whole.parameters():
        nn.init.normal_(param, std=0.3)
    split = Holder(kind)
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
    for by_kind in run_distributed(split_and_whole, 2):
        for kind, (split, whole) in by_kind.items():
            assert set(split) == set(whole) and len(whole) == KINDS[kind], kind
            for name in whole:
                got, want = torch.tensor(split[name]), torch.tensor(whole[name])
                # weighed after the experts, the router's gradient sums partial products: 1e-6 of its largest
                atol = 1e-6 if kind == "before" else 1e-6 * max(1.0, want.abs().max().item())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{kind}: {name}")
