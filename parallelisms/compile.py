"""Regional compilation: torch.compile each transformer block on its own."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from weft.parallelisms.common import TransformError, transformer_blocks

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class CompileOptions:
    """`apply_compile`'s options."""

    backend: str = "inductor"  # torch.compile's ("aot_eager" traces without generating kernels, for debugging)
    fullgraph: bool = True  # each block one graph, or an error


def apply_compile(model: nn.Module, options: CompileOptions = CompileOptions(), *,
                  blocks: Iterable[nn.Module] | None = None, copy_input: bool = False) -> nn.Module:
    """Compile each block's forward in place; identical blocks share one compiled graph, so compile
    time does not grow with depth. blocks None: the model's `layers`, `model.layers` or `transformer.h`.

    Parameter names do not change and hooks on the block (FSDP's all-gathers, transformers' output
    capture) stay outside the compiled region (`nn.Module.compile` would compile them too; why:
    docs/parallelism.md). copy_input: each compiled block reads a copy of its first input
    (`tp_compile_needs_input_copy` says when). A block's record-keeping (an MoE layer's token counts)
    is not repeated by activation checkpointing's recomputation.
    Apply after tensor parallelism and activation checkpointing, before FSDP.
    """
    backend, fullgraph = options.backend, options.fullgraph
    blocks = transformer_blocks(model, "apply_compile", blocks)
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks:
        compiled = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)
        block.forward = _behind_a_copy(compiled) if copy_input else compiled
    copied = ", each behind a copy of its input" if copy_input else ""
    logger.info(f"apply_compile: compiled {len(blocks)} blocks ({backend}, fullgraph={fullgraph}{copied})")
    return model


def _behind_a_copy(compiled):
    @functools.wraps(compiled)
    def forward(hidden, *args, **kwargs):
        return compiled(hidden.clone(), *args, **kwargs)

    return forward


def tp_compile_needs_input_copy(tp_degree: int) -> bool:
    """Whether compiled blocks need `copy_input` under tensor parallelism of `tp_degree`.

    torch 2.13: when a compiled block's input is the local tensor a tensor-parallel DTensor handed
    out (the sequence-parallel residual stream), AOTAutograd's backward returns a gradient that
    DTensor's redistribute cannot take ("'Tensor' object has no attribute '_local_tensor'",
    reproduced by tests/parallelisms/test_own_model.py without the copy). A copy made before the compiled
    region avoids it, at one activation copy per block."""
    return tp_degree > 1 and torch_has_tp_compile_bug()


def check_compile_composes(compile: bool, tp_degree: int, ac_mode: str) -> None:
    """Refuse what torch cannot compile; the one check that a real start and a dry run both make
    (through `parallelize`), so neither says yes alone.

    torch 2.13 with tensor parallelism: blocks compile behind a copy of their input
    (`tp_compile_needs_input_copy`), but not with activation checkpointing as well, where
    AOTAutograd tries to save the DTensors' DeviceMesh for backward ("expected all
    tensors_saved_with_vc_check to be Tensors")."""
    if compile and ac_mode != "none" and tp_compile_needs_input_copy(tp_degree):
        raise TransformError(
            "parallelize", "compile", f"compile with tensor parallelism and activation checkpointing fails in torch "
            f"{torch.__version__} (AOTAutograd saves a DeviceMesh for backward); turn off compile, activation "
            "checkpointing or tensor parallelism"
        )


def torch_has_tp_compile_bug() -> bool:
    """Whether this torch has the compile + tensor parallelism bug of `tp_compile_needs_input_copy`."""
    return torch.__version__.startswith("2.13")
