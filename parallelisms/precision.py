"""One mixed-precision policy for every layout.

`training.mixed_precision_param = bfloat16`: fp32 master weights, gradients and optimizer state;
matmuls in bf16; rotary, norm statistics and the loss in fp32. Under FSDP / HSDP the wrapper
all-gathers parameters already cast to bf16 (`cast_forward_inputs` off); with no FSDP the forward
runs under `torch.autocast`. With `float32` no mechanism is used. Why two mechanisms: docs/install.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The compute dtype of a run and how it is obtained (see the module docstring)."""

    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device_type: str
    fsdp: bool  # True: FSDP's param_dtype casts; False: autocast (if compute_dtype is not fp32)

    @property
    def uses_autocast(self) -> bool:
        return not self.fsdp and self.compute_dtype != torch.float32

    def forward_context(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A factory of the context the forward pass runs in (autocast, or nothing)."""
        if self.uses_autocast:
            return functools.partial(torch.autocast, self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext

    def describe(self) -> str:
        """One line for the startup plan."""
        name = str(self.compute_dtype).removeprefix("torch.")
        if self.compute_dtype == torch.float32:
            return "precision: float32 everywhere"
        how = "FSDP casts gathered parameters" if self.fsdp else "autocast"
        reduce = str(self.reduce_dtype).removeprefix("torch.") if self.fsdp else "float32"
        return (f"precision: matmuls in {name} ({how}); rotary, norms and loss in float32; "
                f"fp32 master weights; gradients reduced in {reduce}")


def precision_policy(param_dtype: str, reduce_dtype: str, *, fsdp: bool, device_type: str) -> PrecisionPolicy:
    """The policy for `training.mixed_precision_param` / `_reduce` in a layout with (`fsdp`) or
    without FSDP. Without FSDP gradients are fp32 and reduced in fp32 (DDP's `replicate` reduces
    what backward produced), so mixed_precision_reduce applies to FSDP only."""
    return PrecisionPolicy(DTYPES[param_dtype], DTYPES[reduce_dtype], device_type, fsdp)


def attention_kernel_warning(device_type: str, compute_dtype: torch.dtype, n_heads: int, n_kv_heads: int) -> str | None:
    """One line when attention would run on SDPA's slow math kernel: float32 with grouped-query
    heads on a GPU (the fused kernels that take grouped-query heads compute in 16-bit); else None."""
    if device_type == "cuda" and compute_dtype == torch.float32 and n_kv_heads < n_heads:
        return ("training.mixed_precision_param = float32 with grouped-query attention: on a GPU attention falls to "
                "SDPA's math kernel (slow, holds the whole score matrix); bfloat16 uses the fused kernels")
    return None
