"""Activation checkpointing: recompute a block's activations in backward instead of keeping them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from weft.parallelisms.common import TransformError, transformer_blocks

logger = logging.getLogger("weft")

AC_MODES = ("none", "full", "selective")

# Outputs worth keeping under the op-level policy: matrix multiplies (float8 ones too) and attention
# (SDPA's kernels, FlexAttention), expensive to recompute; and tensor-parallel reduce-scatters
# (recomputing them would repeat communication).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten._scaled_mm.default,  # float8 matmuls once compile desugars torchao's float8 tensors (eager: mm)
    torch.ops.higher_order.flex_attention,  # packed documents on CUDA
}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_forward(block: nn.Module, op_level: bool) -> None:
    """Wrap block.forward in place, so parameter names (and with them init seeds and checkpoint
    keys) stay exactly as they were.

    Why not torch's composable `torch.distributed._composable.checkpoint`, which keeps names too:
    it runs as forward hooks that hold a Python generator across the call, which dynamo cannot
    trace, so a block compiled with fullgraph=True fails ("reconstructing @contextmanager
    object", torch 2.13). `torch.utils.checkpoint.checkpoint` inside forward compiles natively."""
    forward = block.forward
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy)
        if op_level
        else None
    )

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        return checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn, **kwargs
        )

    block.forward = checkpointed_forward


@dataclass(frozen=True)
class ACOptions:
    """`apply_ac`'s options."""

    mode: str = "none"  # "none", "full" or "selective"
    selective_option: str = "op"  # under "selective": "op", or N to checkpoint every N-th block fully


def apply_ac(model: nn.Module, options: ACOptions = ACOptions(), *,
             blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Checkpoint activations per block.

    mode "full": every block keeps only its input and recomputes the rest in backward.
    mode "selective": selective_option "op" keeps matmul and attention outputs and recomputes
    the cheap element-wise ops; an integer N fully checkpoints every N-th block.

    Apply after tensor parallelism (so the recomputation sees the parallel modules) and before
    compile and FSDP.
    """
    mode, selective_option = options.mode, options.selective_option
    if mode not in AC_MODES:
        raise TransformError("apply_ac", "mode", f"mode: expected one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "selective" and selective_option != "op" and (
        not selective_option.isdecimal() or int(selective_option) < 1
    ):
        raise TransformError(
            "apply_ac", "selective_option", f"selective_option: expected 'op' or a positive integer, got {selective_option!r}"
        )
    if mode == "none":
        return model
    blocks = transformer_blocks(model, "apply_ac", blocks)
    every = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    op_level = mode == "selective" and selective_option == "op"
    wrapped = 0
    for i, block in enumerate(blocks):
        if i % every == 0:
            _checkpoint_forward(block, op_level=op_level)
            wrapped += 1
    what = "op-level (matmul and attention outputs kept)" if op_level else "full"
    logger.info(f"apply_ac: {what} activation checkpointing of {wrapped} of {len(blocks)} blocks")
    return model
