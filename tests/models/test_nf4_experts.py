"""NF4 routed experts (layers/nf4_experts.py, QLoRA's quantize_lora_base): each expert quantized
as torchao quantizes a 2-D weight, and the MoE layer computing with them exactly as a plain one
holding their dequantized values, routing included, without keeping a dequantized stack for the
backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torchao.quantization import to_nf4

from weft.layers import EXPERT_WEIGHTS
from weft.models.common.moe import MoE
from weft.parallelisms.lora import (
    NF4_BLOCK,
    LoRAOptions,
    apply_lora,
    nf4_scaler_block,
    quantize_experts,
    quantize_lora_base,
)

DIM, HIDDEN, EXPERTS = 256, 128, 4


def moe(dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2, shared_hidden_dim=HIDDEN).to(dtype)
    for w in EXPERT_WEIGHTS:
        torch.nn.init.normal_(getattr(layer.experts, w), std=0.02)
    return layer


def quantized_and_reference(dtype: torch.dtype) -> tuple[MoE, MoE]:
    """The layer with NF4 experts (through apply_lora + quantize_lora_base, as train.py does), and a
    plain layer holding the NF4 experts' dequantized values."""
    plain = moe(dtype)
    quantized = apply_lora(copy.deepcopy(plain),
                           LoRAOptions(rank=4, alpha=8.0, target_modules=["wq"], quantize_base="nf4"),
                           allow_no_targets=True)
    quantize_lora_base(quantized)
    reference = copy.deepcopy(plain).requires_grad_(False)
    with torch.no_grad():
        for w in EXPERT_WEIGHTS:
            getattr(reference.experts, w).copy_(getattr(quantized.experts, w).dequantize(dtype))
    return quantized, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_dequantizes_as_torchao_quantizes_it_alone(dtype):
    weight = moe(dtype).experts.w1.detach()
    nf4 = quantize_experts(weight)
    alone = torch.stack([to_nf4(w, NF4_BLOCK, nf4_scaler_block(w.numel())).get_original_weight() for w in weight])
    assert torch.equal(nf4.dequantize(dtype), alone)
    assert nf4.shape == weight.shape and nf4.codes.dtype == torch.uint8
    assert (nf4.dequantize(dtype) - weight).float().norm() < 0.15 * weight.float().norm()  # NF4's error, not noise
    stored = sum(p.numel() * p.element_size() for p in nf4.parameters())
    assert stored < 0.6 * weight.numel()  # about half a byte a value


@pytest.mark.parametrize("dtype,grouped", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)])
def test_the_layer_with_nf4_experts_computes_as_the_dequantized_plain_layer(dtype, grouped, monkeypatch):
    if not grouped:  # the loop over experts (rows not multiples of 16 bytes, float32 on CUDA)
        monkeypatch.setattr("weft.models.common.moe.grouped_mm_applies", lambda x, w1: False)
    quantized, reference = quantized_and_reference(dtype)
    assert all(p.dtype == torch.uint8 for p in [quantized.experts.w1.codes, quantized.experts.w2.codes])
    torch.manual_seed(1)
    x = torch.randn(2, 24, DIM, dtype=dtype)
    xq, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    routes = []
    for layer in (quantized, reference):
        layer.router.register_forward_hook(lambda m, i, o: routes.append(o.detach().topk(2).indices))
    out_q, out_r = quantized(xq), reference(xr)
    assert torch.equal(routes[0], routes[1])
    assert torch.equal(out_q, out_r)
    grad = torch.randn_like(out_q)
    (out_q * grad).sum().backward()
    (out_r * grad).sum().backward()
    torch.testing.assert_close(xq.grad, xr.grad, rtol=0, atol=0)


def largest_saved(layer: MoE) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = layer(torch.randn(1, 24, DIM, requires_grad=True))
    out.pow(2).sum().backward()  # and the backward runs (the NF4 one dequantizing again)
    return max(saved)


def test_no_dequantized_stack_is_kept_for_the_backward():
    quantized, reference = quantized_and_reference(torch.float32)
    stack = EXPERTS * HIDDEN * DIM  # a projection's dequantized experts
    reference.requires_grad_(True)  # a trainable plain stack is saved for its own gradient
    assert largest_saved(reference) >= stack  # the probe sees a kept stack where there is one
    assert largest_saved(quantized) < stack


def test_parameter_counts_see_the_weights_nf4_experts_hold():
    """The model's parameter count (and from it MFU) counts an NF4 stack as its [experts, out, in]
    values, as for an unquantized layer with the same adapters."""
    from weft.layers.nf4_experts import weight_numel
    quantized, reference = quantized_and_reference(torch.float32)
    adapters = sum(p.numel() for n, p in quantized.named_parameters() if ".lora_" in n)
    assert weight_numel(quantized) == sum(p.numel() for p in reference.parameters()) + adapters
    assert sum(p.numel() for p in quantized.parameters()) < weight_numel(quantized) - EXPERTS * HIDDEN * DIM
