"""The one order in which weft's transforms compose. train.py, the benchmarks, the dry run and
the tests all build their models through `parallelize`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from torch import nn

from weft.errors import TransformError
from weft.float8 import Float8Options, apply_float8, check_float8_composes
from weft.parallelisms.ac import ACOptions, apply_ac
from weft.parallelisms.compile import CompileOptions, apply_compile, check_compile_composes, tp_compile_needs_input_copy
from weft.parallelisms.cp import apply_cp
from weft.parallelisms.ep import apply_ep
from weft.parallelisms.fsdp import FSDPOptions, apply_ddp, apply_fsdp
from weft.parallelisms.lora import LoRAOptions, apply_lora, quantize_lora_base
from weft.parallelisms.parallel_dims import Meshes
from weft.parallelisms.pipeline import PipelineOptions, check_stage_composes, splits_backward
from weft.parallelisms.tp import TPOptions, apply_tp, check_tp_composes

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class ParallelizeOptions:
    """What `parallelize` applies: each transform's options; None leaves it out. tp and fsdp
    apply where the meshes ask for them (tensor parallelism, data parallelism or one rank)."""

    lora: LoRAOptions | None = None
    float8: Float8Options | None = None
    tp: TPOptions = field(default_factory=TPOptions)
    ac: ACOptions = field(default_factory=ACOptions)
    compile: CompileOptions | None = None
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    pipeline: PipelineOptions | None = None  # the model is one stage of this pipeline


def check_composes(options: ParallelizeOptions, tp: int = 1) -> None:
    """Refuse, before anything is built, transforms that cannot compose (under `tp` ranks of tensor
    parallelism): each refusal is the transform's own check."""
    quantize_base = options.lora.quantize_base if options.lora is not None else None
    check_compile_composes(options.compile is not None, tp, options.ac.mode)
    if options.float8 is not None:
        check_float8_composes(options.lora is not None)
    if tp > 1:
        check_tp_composes(quantize_base)
    if options.pipeline is not None:
        check_stage_composes(quantize_base)


def parallelize(
    model: nn.Module,
    meshes: Meshes | None,
    options: ParallelizeOptions = ParallelizeOptions(),
    *,
    blocks: Iterable[nn.Module] | None = None,
    before_data_parallel: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply every transform `options` asks for, in the one order that composes; return the model.

    meshes: from `ParallelDims.build_mesh`; None for one plain device (LoRA, float8, AC and compile
    only); meshes of one rank add FSDP over it, for mixed precision. A degree of 1 skips its transform;
    each transform logs one line. options.pipeline: the model is one pipeline stage run by that
    schedule. Then call `materialize` (a meta-device model) or load weights. QLoRA quantizes real
    weights before FSDP shards them: `before_data_parallel` is called just before data parallelism to
    materialize and load the base there.
    """
    dims = meshes.dims if meshes is not None else None
    tp = dims.tp if dims is not None else 1
    blocks = list(blocks) if blocks is not None else None
    check_composes(options, tp)
    # LoRA first: it swaps targeted nn.Linear layers for LoRALinear, which TP splits with their
    # adapters (plans name the same modules) and FSDP shards frozen base and adapters in one unit
    # each block (FSDP2 accepts mixed requires_grad; only the adapters' gradients are reduced).
    if options.lora is not None:  # a pipeline stage may hold none of the targets (only the output)
        apply_lora(model, options.lora, allow_no_targets=options.pipeline is not None)
    # float8 next: it swaps nn.Linear for Float8Linear, which TP splits with its float8 styles and
    # FSDP all-gathers in float8; both must find the float8 layers in place.
    if options.float8 is not None:
        apply_float8(model, options.float8)
    # Expert parallelism spreads the stacked experts over their ranks (DTensors of the ep mesh) and
    # swaps their forward for the all-to-all one, before anything wraps the blocks; FSDP then
    # shards the experts over the ranks that hold the same ones (dp_shard_mod_ep).
    if dims is not None and dims.ep > 1:
        apply_ep(model, meshes.ep, sequence_shards=dims.tp)  # under tp, ep holds tp's ranks (parallel_dims)
    # Tensor parallelism next: it turns weights into DTensor shards, and everything after must
    # wrap the parallel modules, not the plain ones.
    if tp > 1:
        apply_tp(model, meshes.tp, options.tp)
    # Context parallelism swaps the attention core, whatever split the weights have.
    if dims is not None and dims.cp > 1:
        apply_cp(model, meshes.cp)
    # Activation checkpointing wraps each block's forward, so recomputation replays the parallel
    # forward, its TP and CP collectives included.
    apply_ac(model, options.ac, blocks=blocks)
    # Compile traces the checkpointed, parallel block (one graph reused by every block).
    # Under tensor parallelism on torch 2.13 each compiled block reads a copy of its input.
    if options.compile is not None:
        apply_compile(model, options.compile, blocks=blocks, copy_input=tp_compile_needs_input_copy(tp))
    if before_data_parallel is not None:
        before_data_parallel(model)
    _quantize_lora_base(model, options, meshes)
    _apply_data_parallel(model, meshes, options, blocks)
    return model


def pipeline_reshard_policy(reshard_after_forward: str, pipeline_schedule: str | None) -> str:
    """FSDP's reshard policy for a pipeline stage.

    A stage runs forward once per micro-batch, and its backwards come later, interleaved with
    other micro-batches' forwards: keeping the gathered parameters ("never") saves an all-gather
    per micro-batch, so that is the default under pipelining. The schedules that split backward
    into an input part and a later weight part (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
    also need it to be correct: with each block resharded after forward, torch 2.13 computed wrong
    weight gradients (relative error 0.5-1.0, some None), so "always" is refused for them
    (tests/parallelisms/test_pipeline_parity.py trains the split-backward schedules under pp 2 x fsdp 2)."""
    if pipeline_schedule is None:
        return reshard_after_forward
    if reshard_after_forward == "always" and splits_backward(pipeline_schedule):
        raise TransformError(
            "parallelize", "reshard_after_forward", f"reshard_after_forward 'always' gives wrong gradients under the "
            f"{pipeline_schedule} pipeline schedule, which splits backward into input and weight parts; use 'default'")
    return "never" if reshard_after_forward == "default" else reshard_after_forward


def _quantize_lora_base(model: nn.Module, options: ParallelizeOptions, meshes: Meshes | None) -> None:
    """NF4 quantizes whole real weights (its scales depend on all of a weight), so before FSDP
    shards them; FSDP then all-gathers NF4 and each block dequantizes in its matmuls."""
    quantize_base = options.lora.quantize_base if options.lora is not None else None
    dims = meshes.dims if meshes is not None else None
    if quantize_base is not None and any(p.is_meta for p in model.parameters()):
        logger.warning("parallelize: the model is on the meta device, so the LoRA base stays unquantized (a plan, "
                       "as in the dry run); quantize real weights through before_data_parallel")
    elif quantize_base is not None:
        quantize_lora_base(model, shards=meshes.fsdp.shape[-1] if dims is not None and dims.fsdp_enabled else 1)


def _apply_data_parallel(model: nn.Module, meshes: Meshes | None, options: ParallelizeOptions,
                         blocks: list[nn.Module] | None) -> None:
    """Data parallelism last: FSDP shards (DDP replicates) whatever parameters the model now has,
    TP's DTensors included (2-D sharding), and hooks its communication around the compiled blocks.
    Meshes of a single rank still get FSDP, for its mixed precision (bf16 compute, fp32 master)."""
    dims = meshes.dims if meshes is not None else None
    if dims is not None and (dims.fsdp_enabled or dims.world_size == 1):
        schedule = options.pipeline.schedule if options.pipeline is not None else None
        reshard = pipeline_reshard_policy(options.fsdp.reshard_after_forward, schedule)
        apply_fsdp(model, meshes.fsdp, replace(options.fsdp, reshard_after_forward=reshard), blocks=blocks,
                   expert_mesh=meshes.expert_fsdp)
    elif dims is not None and dims.ddp_enabled:
        apply_ddp(model, meshes.dp_replicate)
