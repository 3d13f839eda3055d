"""Regional compilation: torch.compile each transformer block on its own."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from parallelisms.fsdp import transformer_blocks


def apply_compile(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Compile each block's forward; identical blocks share one compiled graph, so compile time
    does not grow with depth.

    The block's forward is replaced in place: parameter names do not change, and the FSDP
    hooks added afterwards stay outside the compiled region (their collectives are not traced).
    Apply after tensor parallelism and activation checkpointing, before FSDP.
    """
    blocks = transformer_blocks(model) if blocks is None else list(blocks)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=True)
    return model
