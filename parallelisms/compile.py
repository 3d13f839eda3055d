"""Regional compilation: torch.compile each transformer block on its own."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from parallelisms.common import TransformError, transformer_blocks

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


def check_compile_composes(compile: bool, tp_degree: int) -> None:
    """Refuse compile with tensor parallelism where torch cannot run them together; the one check
    that both a real start and a dry run make (through `parallelize`), so neither says yes alone.

    torch 2.13: backward through a compiled block with tensor-parallel DTensors raises
    "'Tensor' object has no attribute '_local_tensor'" in DTensor's NestedRedistribute
    (tests/test_own_model.py reproduces it, so a torch that fixes it is noticed)."""
    if compile and tp_degree > 1 and torch_has_tp_compile_bug():
        raise TransformError(
            "parallelize", "compile", f"compile with tensor parallelism fails in torch {torch.__version__}'s "
            "DTensor backward (a compiled block hands a plain gradient to DTensor's redistribute); turn off "
            "compile or tensor parallelism"
        )


def torch_has_tp_compile_bug() -> bool:
    """Whether this torch has the compile + tensor parallelism bug of `check_compile_composes`."""
    return torch.__version__.startswith("2.13")
