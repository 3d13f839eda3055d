"""The one order in which weft's transforms compose. train.py, the benchmarks, the dry run and
the tests all build their models through `parallelize`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from parallelisms.ac import apply_ac
from parallelisms.common import TransformError
from parallelisms.compile import apply_compile, check_compile_composes, tp_compile_needs_input_copy
from parallelisms.cp import apply_cp
from parallelisms.fsdp import apply_ddp, apply_fsdp
from parallelisms.parallel_dims import Meshes
from parallelisms.tp import Plan, apply_tp


def parallelize(
    model: nn.Module,
    meshes: Meshes | None,
    *,
    blocks: Iterable[nn.Module] | None = None,
    float8_recipe: str | None = None,
    float8_filter_fqns: Iterable[str] = (),
    float8_min_dim: int | None = None,
    float8_fsdp_all_gather: bool = False,
    float8_tp_all_gather: bool = False,
    tp_plan: Plan | None = None,
    loss_parallel: bool = False,
    ac_mode: str = "none",
    ac_selective_option: str = "op",
    compile: bool = False,
    compile_backend: str = "inductor",
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pipeline_schedule: str | None = None,
) -> nn.Module:
    """Apply every transform the arguments ask for, in the one order that composes; return the model.

    meshes: from `ParallelDims.build_mesh`; None for one plain device (float8, AC and compile
    only); meshes of one rank add FSDP over it, for mixed precision.
    A degree of 1 skips its transform. Each transform logs one line saying what it did.
    pipeline_schedule: the model is one pipeline stage (parallelisms/pipeline.py cut it) run by
    this torch schedule; it decides FSDP's resharding below.
    Then call `materialize` (a meta-device model) or load weights.
    """
    dims = meshes.dims if meshes is not None else None
    blocks = list(blocks) if blocks is not None else None
    check_compile_composes(compile, dims.tp if dims is not None else 1, ac_mode)
    # float8 first: it swaps nn.Linear for Float8Linear, which TP splits with its float8 styles and
    # FSDP all-gathers in float8; both must find the float8 layers in place.
    if float8_recipe is not None:
        from float8 import DEFAULT_MIN_DIM, apply_float8

        apply_float8(
            model,
            recipe=float8_recipe,
            filter_fqns=float8_filter_fqns,
            enable_fsdp_float8_all_gather=float8_fsdp_all_gather,
            min_dim=DEFAULT_MIN_DIM if float8_min_dim is None else float8_min_dim,
        )
    # Tensor parallelism next: it turns weights into DTensor shards, and everything after must
    # wrap the parallel modules, not the plain ones.
    if dims is not None and dims.tp > 1:
        apply_tp(model, meshes.tp, tp_plan, loss_parallel=loss_parallel, float8_all_gather=float8_tp_all_gather)
    # Context parallelism swaps the attention core, whatever split the weights have.
    if dims is not None and dims.cp > 1:
        apply_cp(model, meshes.cp)
    # Activation checkpointing wraps each block's forward, so recomputation replays the parallel
    # forward, its TP and CP collectives included.
    apply_ac(model, ac_mode, ac_selective_option, blocks)
    # Compile traces the checkpointed, parallel block (one graph reused by every block).
    # Under tensor parallelism on torch 2.13 each compiled block reads a copy of its input.
    if compile:
        apply_compile(model, blocks, backend=compile_backend,
                      copy_input=tp_compile_needs_input_copy(dims.tp if dims is not None else 1))
    # Data parallelism last: FSDP shards (DDP replicates) whatever parameters the model now has,
    # TP's DTensors included (2-D sharding), and hooks its communication around the compiled blocks.
    # Meshes of a single rank still get FSDP, for its mixed precision (bf16 compute, fp32 master).
    if dims is not None and (dims.fsdp_enabled or dims.world_size == 1):
        apply_fsdp(
            model,
            meshes.fsdp,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=pipeline_reshard_policy(reshard_after_forward, pipeline_schedule),
            cpu_offload=cpu_offload,
            blocks=blocks,
        )
    elif dims is not None and dims.ddp_enabled:
        apply_ddp(model, meshes.dp_replicate)
    return model


def pipeline_reshard_policy(reshard_after_forward: str, pipeline_schedule: str | None) -> str:
    """FSDP's reshard policy for a pipeline stage.

    A stage runs forward once per micro-batch, and its backwards come later, interleaved with
    other micro-batches' forwards: keeping the gathered parameters ("never") saves an all-gather
    per micro-batch, so that is the default under pipelining. The schedules that split backward
    into an input part and a later weight part (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
    also need it to be correct: with each block resharded after forward, torch 2.13 computed wrong
    weight gradients (relative error 0.5-1.0, some None), so "always" is refused for them
    (tests/test_pipeline_parity.py trains every schedule under pp 2 x fsdp 2)."""
    if pipeline_schedule is None:
        return reshard_after_forward
    from parallelisms.pipeline import splits_backward

    if reshard_after_forward == "always" and splits_backward(pipeline_schedule):
        raise TransformError(
            "parallelize", "reshard_after_forward", f"reshard_after_forward 'always' gives wrong gradients under the "
            f"{pipeline_schedule} pipeline schedule, which splits backward into input and weight parts; use 'default'")
    return "never" if reshard_after_forward == "default" else reshard_after_forward

