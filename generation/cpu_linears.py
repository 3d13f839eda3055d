"""Linear layers computed weights-first while a model decodes on CPU.

A decode step multiplies a few rows (one token per running sequence) by every weight of the model.
On CPU, BLAS multiplies them faster as (W @ x^T)^T, the weight the left operand, than as x @ W^T,
which nn.Linear computes, for a few to about a hundred rows on this project's 2-core machine (most for
the large output projection); at one row or hundreds the two are even. The products are the same,
summed in another order. benchmarks/generation.py measures the engine with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 128  # beyond this many rows nn.Linear's own order is as fast


def _weights_first(module: nn.Linear):
    """A forward for `module`: weights-first for 2 to MAX_ROWS rows of a plain weight, nn.Linear's otherwise.
    The weight is read at each call (FSDP swaps its parameters between calls)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        rows = x.numel() // module.in_features
        if not 1 < rows <= MAX_ROWS or type(weight.data) is not torch.Tensor:  # noqa: E721 (DTensor, NF4: their own)
            return F.linear(x, weight, bias)
        out = (weight @ x.reshape(rows, module.in_features).T).T.contiguous()
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], module.out_features)

    return forward


@contextmanager
def weights_first_linears(model: nn.Module) -> Iterator[None]:
    """While inside: every nn.Linear of `model` (not its subclasses: float8's, adapters') on CPU
    computes few rows weights-first; each forward is put back on leaving."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"  # noqa: E721
               and "forward" not in vars(m)]  # one patched already keeps its own
    for module in linears:
        module.forward = _weights_first(module)
    try:
        yield
    finally:
        for module in linears:
            del module.forward
