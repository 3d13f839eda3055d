"""parallelisms/ac.py: what op-level selective activation checkpointing keeps instead of recomputing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.ac import ACOptions, _save_matmuls_policy, apply_ac

from tests.support.slow_scaled_mm import emulated_scaled_mm


def scaled_mm_calls(ac_mode: str, monkeypatch) -> int:
    """torch._scaled_mm calls (torchao's float8 matmuls) of one float8 forward + backward of a 2-block model."""
    pytest.importorskip("torchao")
    from weft.float8 import Float8Options, apply_float8

    model = Transformer(replace(LLAMA_FLAVORS["debugmodel"], n_layers=2))
    model.init_weights(seed=0)
    apply_float8(model, Float8Options(filter_fqns=["output"], min_dim=16))
    apply_ac(model, ACOptions(ac_mode, "op"))
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return emulated_scaled_mm(*args, **kwargs)  # how many there are matters here, not the kernel

    with monkeypatch.context() as patch:
        patch.setattr(torch, "_scaled_mm", counting)
        model(tokens).float().sum().backward()
    return len(calls)


def test_op_level_ac_keeps_float8_matmul_outputs(monkeypatch):
    """Forward: one float8 matmul per linear; backward: two. Kept outputs are not recomputed, so
    op-level AC makes exactly as many as no AC, and full AC one forward's worth more. (Eagerly the
    policy sees them as aten.mm on torchao's float8 tensors; compiled, as aten._scaled_mm.)"""
    plain = scaled_mm_calls("none", monkeypatch)
    assert plain == 3 * 14  # 7 float8 linears per block, 2 blocks
    assert scaled_mm_calls("selective", monkeypatch) == plain
    assert scaled_mm_calls("full", monkeypatch) == plain + 14


def test_op_level_ac_keeps_flex_attention_outputs():
    """FlexAttention (packed documents on CUDA) has no CPU backward in torch 2.13: the policy only."""
    assert _save_matmuls_policy(None, torch.ops.higher_order.flex_attention) == CheckpointPolicy.MUST_SAVE
    assert _save_matmuls_policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
