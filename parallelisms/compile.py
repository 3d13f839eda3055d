"""Regional compilation: torch.compile each transformer block on its own."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from parallelisms.common import transformer_blocks

logger = logging.getLogger("weft")


def apply_compile(
    model: nn.Module, blocks: Iterable[nn.Module] | None = None, *, backend: str = "inductor", fullgraph: bool = True
) -> nn.Module:
    """Compile each block's forward; identical blocks share one compiled graph, so compile time
    does not grow with depth. blocks None: the model's `layers`, `model.layers` or `transformer.h`.

    The forward is replaced in place, so the module tree and parameter names do not change, and
    hooks that others register on the block (FSDP's all-gathers, transformers' output capture)
    stay outside the compiled region. `nn.Module.compile` would compile those hooks too: on a
    transformers LlamaDecoderLayer under FSDP and activation checkpointing it fails in
    AOTAutograd (torch 2.13: "expected all tensors_saved_with_vc_check to be Tensors").
    backend: torch.compile's ("aot_eager" traces without generating kernels, for debugging).
    Apply after tensor parallelism and activation checkpointing, before FSDP.
    """
    blocks = transformer_blocks(model, "apply_compile", blocks)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)
    logger.info(f"apply_compile: compiled {len(blocks)} blocks ({backend}, fullgraph={fullgraph})")
    return model
