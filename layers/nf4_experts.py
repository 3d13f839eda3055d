"""Routed experts stored in NF4 (QLoRA's 4-bit NormalFloat, Dettmers et al., 2023), expert by expert.

A stack of experts [experts, out, in] is quantized one expert at a time by torchao, and the pieces of
every expert's NF4 tensor (codes, block scales, the groups' factors, the scales' mean) are kept
stacked along the expert dimension, so FSDP and expert parallelism hand out whole experts.
`NF4Experts` stands where `GroupedExperts` keeps a weight; `frozen_experts_matmul` dequantizes the
stack for the multiply and again in the backward, so no dequantized stack outlives its matmul
(docs/lora-moe.md).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weft.layers.torchao_import import quiet_torchao_import

# The pieces of torchao's NF4Tensor kept per expert, stacked: (name here, NF4Tensor attribute).
PIECES = (("codes", "quantized_data"), ("scales", "quantized_scalers"), ("factors", "quantization_factor"),
          ("scale_mean", "scaler_mean"))


@functools.cache
def torchao_nf4() -> tuple[type, Callable, type]:
    """torchao's NF4Tensor, to_nf4 and SubclassTensorArgs, imported on first use (importing weft
    must not need torchao) and kept by each NF4Experts, so a compiled forward reads no import."""
    with quiet_torchao_import():
        try:  # torchao >= 0.18
            from torchao.quantization import NF4Tensor, to_nf4
        except ImportError:  # torchao 0.17 and older keep it with the dtypes
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
    return NF4Tensor, to_nf4, importlib.import_module(NF4Tensor.__module__).SubclassTensorArgs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class NF4Experts(nn.Module):
    """A frozen stack of expert weights [experts, out, in], each expert quantized to NF4 by torchao
    (blocks of `block_size` values, scales grouped by `scaler_block_size`)."""

    def __init__(self, weight: torch.Tensor, block_size: int, scaler_block_size: int):
        super().__init__()
        self.nf4_types = torchao_nf4()
        to_nf4 = self.nf4_types[1]
        experts = [to_nf4(w, block_size, scaler_block_size) for w in weight.detach()]
        for name, attribute in PIECES:
            piece = torch.stack([getattr(e, attribute) for e in experts])
            self.register_parameter(name, nn.Parameter(piece, requires_grad=False))
        self.register_buffer("levels", experts[0].nf4.clone(), persistent=False)  # the 16 NF4 values
        self.block_size, self.scaler_block_size = block_size, scaler_block_size
        self.expert_shape = tuple(weight.shape[1:])
        self.weight_dtype = weight.dtype

    @property
    def shape(self) -> torch.Size:
        """[experts here (this rank's, under expert parallelism), out, in]."""
        return torch.Size((_local(self.codes).shape[0], *self.expert_shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_dtype

    def dequantize(self, dtype: torch.dtype, whole: bool = False) -> torch.Tensor:
        """The stack in `dtype`, [experts here, out, in], each expert by torchao's own dequantization;
        whole: every expert, gathered from the ranks that hold them (a collective: call on all)."""
        NF4Tensor, _, SubclassTensorArgs = self.nf4_types
        whole_or_local = (lambda t: t.full_tensor() if isinstance(t, DTensor) else t) if whole else _local
        codes, scales, factors, mean = (whole_or_local(getattr(self, name)) for name, _ in PIECES)
        out, in_ = self.expert_shape
        args = SubclassTensorArgs(original_shape=torch.Size((out, in_)), original_strides=(in_, 1), storage_offset=0,
                                  dtype=self.weight_dtype, device=codes.device, requires_grad=False)
        n_blocks = out * in_ // self.block_size
        stack = torch.empty((codes.shape[0], out, in_), dtype=dtype, device=codes.device)
        for e in range(codes.shape[0]):  # one expert's torchao work at a time beside the stack
            stack[e] = NF4Tensor(args, self.block_size, n_blocks, self.scaler_block_size, scales[e],
                                 factors[e].to(self.weight_dtype), mean[e].to(self.weight_dtype), codes[e],
                                 self.levels.to(self.weight_dtype)).get_original_weight()
        return stack

    def extra_repr(self) -> str:
        return f"experts={self.shape[0]}, shape={self.expert_shape}, NF4 blocks of {self.block_size}"


class _FrozenExpertsMatmul(torch.autograd.Function):
    """x @ w[e]^T for each expert's rows, w dequantized from NF4 in forward and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, w: NF4Experts, matmul) -> torch.Tensor:
        ctx.save_for_backward(counts)
        ctx.w, ctx.matmul = w, matmul
        return matmul(x, counts, w.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (counts,) = ctx.saved_tensors
        grad = grad.contiguous()
        return ctx.matmul(grad, counts, ctx.w.dequantize(grad.dtype).transpose(1, 2)), None, None, None


def frozen_experts_matmul(x: torch.Tensor, counts: torch.Tensor, w: NF4Experts, matmul) -> torch.Tensor:
    """`matmul(x, counts, weight)` (rows sorted by expert, weight [experts, out, in]) with `w`'s
    dequantized weight, which is not kept for the backward."""
    return _FrozenExpertsMatmul.apply(x, counts, w, matmul)


def weight_numel(module: nn.Module) -> int:
    """The values `module`'s parameters stand for: each parameter's numel, an NF4 stack's as the
    [experts, out, in] weight it holds (not its codes' bytes); parameters under FSDP or expert
    parallelism count whole."""
    stacks = [m for m in module.modules() if isinstance(m, NF4Experts)]
    inside = {id(p) for m in stacks for p in m.parameters()}
    return (sum(p.numel() for p in module.parameters() if id(p) not in inside)
            + sum(m.codes.shape[0] * m.expert_shape[0] * m.expert_shape[1] for m in stacks))
