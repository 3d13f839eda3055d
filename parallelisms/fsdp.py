"""Data parallelism: FSDP2 (`fully_shard`) with HSDP on a 2-D mesh, and DDP for pure replication."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from weft.parallelisms.common import TransformError, transformer_blocks
from weft.parallelisms.ep import expert_modules

logger = logging.getLogger("weft")

RESHARD_POLICIES = ("default", "always", "never")


def fsdp_shard_dim(shape: torch.Size | list[int], ranks: int) -> int:
    """The dimension FSDP splits a parameter of `shape` over `ranks` along: dim 0, except for a
    weight with fewer rows than ranks (stacked experts [experts, out, in] with fewer experts, a
    router with fewer experts): its largest dimension, so that every rank holds a share instead
    of each of the first ranks a whole row."""
    if len(shape) < 2 or shape[0] >= ranks:
        return 0
    return max(range(len(shape)), key=lambda dim: shape[dim])


@dataclass(frozen=True)
class FSDPOptions:
    """`apply_fsdp`'s options."""

    param_dtype: torch.dtype = torch.bfloat16  # the dtype blocks compute in
    reduce_dtype: torch.dtype = torch.float32  # the dtype gradients are reduced in
    reshard_after_forward: str = "default"  # "default", "always" or "never" (below)
    cpu_offload: bool = False  # keep the shards, gradients and optimizer step on the CPU
    cast_forward_inputs: bool = False  # cast each block's floating inputs to param_dtype (below)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, options: FSDPOptions = FSDPOptions(), *,
               blocks: Iterable[nn.Module] | None = None, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard parameters, gradients and optimizer state over `dp_mesh` with FSDP2: each block is its
    own unit, the root takes the rest; a 2-D mesh (replicate, shard) gives HSDP. Master weights stay
    in the parameters' dtype; compute runs in `param_dtype`, gradients reduce in `reduce_dtype`.

    reshard_after_forward: "always" (FULL_SHARD), "never" (SHARD_GRAD_OP), "default" (all but the last
    block). cast_forward_inputs off by default (rotary tables stay in full precision). Weights with
    fewer rows than shard ranks split on another dim (`fsdp_shard_dim`). expert_mesh: where apply_ep
    spread the experts; each block's experts become their own unit sharded over it.
    Apply after tensor parallelism, activation checkpointing and compile, before `materialize`.
    """
    param_dtype, reduce_dtype, cpu_offload = options.param_dtype, options.reduce_dtype, options.cpu_offload
    reshard_after_forward = options.reshard_after_forward
    if reshard_after_forward not in RESHARD_POLICIES:
        raise TransformError(
            "apply_fsdp",
            "reshard_after_forward",
            f"reshard_after_forward: expected one of {', '.join(RESHARD_POLICIES)}, got {reshard_after_forward!r}",
        )
    blocks = transformer_blocks(model, "apply_fsdp", blocks)
    ranks = dp_mesh.shape[-1]  # HSDP shards over the last dimension of its (replicate, shard) mesh

    def placement(param: nn.Parameter) -> Shard | None:  # tensor-parallel DTensors keep dim 0
        dim = 0 if isinstance(param, DTensor) else fsdp_shard_dim(param.shape, ranks)
        return Shard(dim) if dim else None

    def expert_placement(param: nn.Parameter) -> Shard | None:  # a rank's experts, by the same rule
        dim = fsdp_shard_dim(param.to_local().shape, expert_mesh.size())
        return Shard(dim) if dim else None

    settings = dict(
        mesh=dp_mesh,
        shard_placement_fn=placement,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                       cast_forward_inputs=options.cast_forward_inputs),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        for experts in expert_modules(block) if expert_mesh is not None else ():
            fully_shard(experts, reshard_after_forward=reshard,
                        **{**settings, "mesh": expert_mesh, "shard_placement_fn": expert_placement})
        fully_shard(block, reshard_after_forward=reshard, **settings)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **settings)
    if dp_mesh.ndim == 2:
        kind = f"hsdp over dp_mesh {tuple(dp_mesh.shape)} (replicate, shard)"
    else:
        kind = f"fsdp over dp_mesh size {dp_mesh.size()}"
    if expert_mesh is not None:
        kind += f", experts over expert_mesh size {expert_mesh.size()}"
    logger.info(
        f"apply_fsdp: {kind}: {len(blocks)} blocks and the root, reshard_after_forward={reshard_after_forward}, "
        f"param_dtype={_dtype_name(param_dtype)}, reduce_dtype={_dtype_name(reduce_dtype)}"
        + (", parameters offloaded to CPU" if cpu_offload else "")
    )
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate the model over `dp_mesh`; gradients are averaged across replicas after backward.

    Uses PyTorch's FSDP2-based `replicate`, which (unlike classic DDP) composes with tensor
    parallel DTensor parameters. Apply in the same place as apply_fsdp: last, before the model
    is materialised.
    """
    replicate(model, mesh=dp_mesh)
    logger.info(f"apply_ddp: replicated over dp_mesh size {dp_mesh.size()}, gradients averaged after backward")
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
