"""--job.dry_run: plan a run of any size in one process, without devices, and say whether it fits.

The run's own plan (recipe/plan.py) is built for the planned world size and its model is built
on the meta device by `recipe.build.build_model`, over a fake process group of that size: a
layout that would fail at start fails here with the same one-line error. Then the plan (mesh,
each transform's log line, parameters per rank, batch, tokens per step) and the memory estimate
of components/memory.py are printed; nothing is written.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from weft.components.config import ConfigError, JobConfig
from weft.components.distributed.processes import init_fake_distributed, launched_world_size
from weft.components.ft.checks import describe_groups
from weft.components.memory import (
    GIB,
    MemoryEstimate,
    StepShape,
    device_memory_gib,
    dtype_bytes,
    estimate_memory,
    qlora_startup_bytes,
    tp_fsdp_state_bytes,
    training_state_bytes,
)
from weft.components.observe.log import setup_logging
from weft.errors import UserError
from weft.models import spec_for_args
from weft.parallelisms.common import transformer_blocks
from weft.parallelisms.lora import apply_lora
from weft.parallelisms.parallel_dims import LayoutError, ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions
from weft.parallelisms.pipeline import (
    PipelineLayout,
    PipelineStages,
    activations_in_flight,
    default_split,
    split_model,
)
from weft.parallelisms.precision import DTYPES, precision_policy
from weft.recipe.build import build_model, build_stages, model_line
from weft.recipe.checks.experts import prepare_experts
from weft.recipe.objectives import Objective
from weft.recipe.plan import RunPlan, check_layout, pipeline_layout
from weft.recipe.summary import global_batch_line

logger = logging.getLogger("weft")


def planned_world_size(cfg: JobConfig) -> int:
    """job.dry_run_world_size, else job.simulate_world_size, else the product of the degrees
    (dp_shard -1 counting as 1): the smallest world the config's own layout plans for."""
    if cfg.job.dry_run_world_size or cfg.job.simulate_world_size:
        return cfg.job.dry_run_world_size or cfg.job.simulate_world_size
    p = cfg.parallelism
    return p.pp * p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp


def step_shape(cfg: JobConfig, args: Any, dims: ParallelDims, rows_per_sample: int = 1) -> StepShape:
    """What the memory estimate needs from the config and layout. Compute dtype and mechanism are
    train.py's precision policy (parallelisms/precision.py): FSDP's param dtype, else autocast.
    rows_per_sample: the objective's (a preference pair is two rows)."""
    t = cfg.training
    param_dtype = DTYPES[t.mixed_precision_param]
    policy = precision_policy(t.mixed_precision_param, t.mixed_precision_reduce, fsdp=dims.fsdp_enabled,
                              device_type="cuda")
    compute = policy.compute_dtype
    return StepShape(
        args=args, local_batch=t.local_batch_size * rows_per_sample, seq_len=t.seq_len, tp=dims.tp, cp=dims.cp,
        fsdp=dims.dp_shard * dims.cp if dims.fsdp_enabled else 1, ep=dims.ep,
        ep_imbalance=cfg.job.dry_run_ep_imbalance, compute_dtype=compute,
        param_dtype=param_dtype,
        reduce_dtype=DTYPES[t.mixed_precision_reduce], ac_mode=cfg.activation_checkpoint.mode,
        ac_option=cfg.activation_checkpoint.selective_option, float8=cfg.float8.enable,
        loss_parallel=cfg.parallelism.loss_parallel, compiled_loss=cfg.compile.enable, autocast=policy.uses_autocast,
        foreach_optimizer=cfg.optimizer.implementation == "foreach",  # "auto" is fused on GPUs (components/training/optim.py)
        muon_exclude=tuple(cfg.optimizer.muon_exclude) if cfg.optimizer.name == "Muon" else None,
        muon_ns_bytes=dtype_bytes(DTYPES[cfg.optimizer.muon_ns_dtype]),
        lora_rank=cfg.lora.rank if cfg.lora.enable else 0,
    )


def pipeline_step_shape(shape: StepShape, layout, stages, pp_group, pp_rank: int) -> StepShape:
    """The step shape of pipeline rank `pp_rank`'s stages: one micro-batch at a time, its blocks only,
    as many micro-batches in flight as its schedule keeps, the embedding and output where it has them."""
    blocks = {stage_id: len(transformer_blocks(stage, "pipeline_step_shape"))  # weft's layers, transformers' model.layers
              for stage_id, stage in zip(stages.stage_ids, stages)}
    held = activations_in_flight(layout, pp_rank, pp_group, blocks)
    return dataclasses.replace(
        shape, local_batch=shape.local_batch // layout.microbatches, blocks=held.blocks,
        blocks_with_gradients=held.blocks_with_gradients, in_flight=held.logits,
        first_stage=stages.has_first_stage, last_stage=stages.has_last_stage,
        gathered_blocks=sum(blocks.values()))  # FSDP never reshards under a pipeline


def edge_pp_ranks(pp: int) -> list[int]:
    """The pipeline ranks whose memory bounds the others': the first (the embedding, and the most
    micro-batches in flight) and the last (the output and the logits); one rank under the V
    schedules, which place both on rank 0, still gives both."""
    return sorted({0, pp - 1})


def stage_estimates(plan: RunPlan, stages, meshes, shape: StepShape) -> dict[int, MemoryEstimate]:
    """The estimate of each pipeline rank of `edge_pp_ranks`, its stages built on meta as that rank
    builds them (this rank's are `stages`)."""

    own = meshes.pp.get_local_rank()
    estimates = {}
    for pp_rank in edge_pp_ranks(plan.dims.pp):
        held = stages if pp_rank == own else build_stages(plan, stages.whole_model, meshes, None, pp_rank=pp_rank)
        estimates[pp_rank] = estimate_memory(
            held, pipeline_step_shape(shape, plan.pipeline, held, meshes.pp.get_group(), pp_rank))
    return estimates


def dry_run(cfg: JobConfig) -> MemoryEstimate:
    """Plan, build on meta, print the plan and the estimate; raise ConfigError (exit 2) if it does not fit."""
    if launched_world_size() > 1:
        raise ConfigError(f"job.dry_run: plans in one process (python train.py), not {launched_world_size()}")
    limit = _memory_limit(cfg.job.dry_run_device_memory_gib)
    world_size = planned_world_size(cfg)
    try:
        plan = RunPlan.from_config(cfg, world_size, device_type="cuda", check_environment=False)
    except LayoutError as e:
        source = ("job.dry_run_world_size" if cfg.job.dry_run_world_size else
                  "job.simulate_world_size" if cfg.job.simulate_world_size else "the product of the degrees")
        raise LayoutError(f"{e} (the dry run planned {world_size} ranks: {source})") from None
    args, dims = plan.model_args, plan.dims
    setup_logging(0)
    logger.info(f"dry run: {dims.world_size} ranks planned in one process on the meta device, nothing written")
    if dims.world_size > 1:
        init_fake_distributed(dims.world_size)
    meshes = dims.build_mesh("cpu") if dims.world_size > 1 else None
    logger.info(f"mesh: {dims.describe()}")
    if cfg.fault_tolerance.enable:
        logger.info(describe_groups(cfg, dims.world_size))
    # Every transform a real start applies, compile included (it only wraps forwards until their first
    # call), so the dry run refuses exactly what a real start refuses (compile + TP on torch 2.13).
    model = build_model(plan, meshes, device=None)
    logger.info(model_line(plan, model))
    logger.info(global_batch_line(plan))

    estimate = print_estimate(plan, model, meshes)
    table, best = layouts_table(cfg, args, dims, limit, plan.options, plan.objective)
    print(table)
    _verdict(estimate, limit, cfg, dims, best)
    return estimate


def print_estimate(plan: RunPlan, model: nn.Module, meshes) -> MemoryEstimate:
    """Print the memory estimate of the planned run and return it: of the one model, or of each
    pipeline rank that bounds memory (the larger returned); with QLoRA, its start-up as a phase."""
    cfg, args, frozen = plan.cfg, plan.model_args, plan.objective.frozen(plan.cfg)
    shape = step_shape(cfg, args, plan.dims, plan.objective.rows_per_sample)
    heading = (f"memory per device (estimate; compute {_name(shape.compute_dtype)}, "
               f"activation checkpointing {_ac(cfg)}, float8 {'on' if cfg.float8.enable else 'off'})")
    if plan.pipeline is None:
        estimate = estimate_memory(model, shape)
        if frozen is not None and frozen.mode == "copy":  # beside the policy, sharded like it
            reference = training_state_bytes(frozen.copy(plan, meshes, None))[0]
            estimate.buffers[f"{frozen.name} (frozen copy's weights)"] = reference
            if frozen.precompute:  # held only for the first pass, before any optimizer state
                estimate.phases[f"{frozen.name} precompute pass"] = estimate.parameters + reference
            else:  # held all run long
                estimate.phases = {phase: size + reference for phase, size in estimate.phases.items()}
        print(f"{heading}:")
        print(estimate.table())
    else:
        logger.info(plan.pipeline.describe())
        estimates = stage_estimates(plan, model, meshes, shape)
        for pp_rank, stage_estimate in estimates.items():
            ids = plan.pipeline.stage_ids(pp_rank)
            print(f"{heading}, pipeline rank {pp_rank} of {plan.dims.pp} (stages {', '.join(map(str, ids))}"
                  f"{' with the embedding' if 0 in ids else ''}"
                  f"{' with the output' if plan.pipeline.n_stages - 1 in ids else ''}):")
            print(stage_estimate.table())
        worst = max(estimates, key=lambda r: estimates[r].peak)
        estimate = estimates[worst]
        if len(estimates) > 1:
            print(f"the largest: pipeline rank {worst}")
    if frozen is not None and frozen.mode == "adapters_off":
        print(f"  {frozen.name}: the model with its LoRA adapters off (no second copy)")
    if cfg.lora.enable and cfg.lora.quantize_base:  # every rank quantizes the whole base before FSDP shards it
        startup = qlora_startup_bytes(model, args, shape.compute_dtype, plan.dims.ep)
        estimate.phases["QLoRA start-up"] = startup
        print(f"  QLoRA start-up, before FSDP shards the base: {startup / GIB:.2f} GiB "
              "(the whole base in NF4, one block in the compute dtype, torchao quantizing one weight)")
    line = kv_cache_line(plan, shape.compute_dtype)
    if line:
        print(line)
    return estimate


def kv_cache_line(plan: RunPlan, dtype: torch.dtype) -> str | None:
    """The KV cache generating would hold on one device (weft.generation: the objective's generation batch
    of seq_len-token sequences, prompt and completion, tp splitting the kv heads); None where the spec
    cannot say ahead."""
    cfg, args = plan.cfg, plan.model_args
    cache_bytes = plan.spec.backend.decoding.cache_bytes
    if cache_bytes is None:
        return None
    rows, length = plan.objective.generation_rows(cfg, plan.dims), cfg.training.seq_len
    size = cache_bytes(args, rows, length, dtype.itemsize) / plan.dims.tp
    return (f"  KV cache to generate {rows} sequences of {length} tokens ({_name(dtype)}): {size / GIB:.2f} GiB "
            f"per device ({plan.objective.generation_note})")


# The largest pipeline degree the table of other layouts tries (the field's largest is 8 to 16).
TABLE_MAX_PP = 16


def candidate_layouts(cfg: JobConfig, args: Any, world_size: int) -> list[ParallelDims]:
    """pp × dp_shard × cp × tp factorisations of the world (dp_replicate as configured; pp up to
    TABLE_MAX_PP; tp dividing the query and key/value heads) where the config's run is valid
    (`check_layout`: the sequence split, the transforms' composition, the model's experts, the
    pipeline's schedule and micro-batches). A model with experts also gets each ep that
    divides dp_shard × cp × tp and is a multiple of tp."""
    replicate = cfg.parallelism.dp_replicate if world_size % cfg.parallelism.dp_replicate == 0 else 1
    rest = world_size // replicate
    layouts, spec = [], spec_for_args(args)
    for pp in (d for d in _divisors(rest) if d <= TABLE_MAX_PP):
        for tp in _divisors(rest // pp):
            if args.n_heads % tp or args.kv_heads % tp:
                continue
            for cp in _divisors(rest // pp // tp):
                shard = rest // pp // tp // cp
                for ep in (d for d in _divisors(shard * cp * tp) if d == 1 or d % tp == 0):
                    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, world_size=world_size,
                                        pp=pp, ep=ep)
                    try:
                        check_layout(cfg, spec, args, dims, "cuda")
                    except UserError:
                        continue
                    layouts.append(dims)
    return layouts


def layouts_table(cfg: JobConfig, args: Any, current: ParallelDims, limit: float | None, options: ParallelizeOptions,
                  objective: type[Objective], rows: int = 12) -> tuple[str, tuple[int, ParallelDims]]:
    """The estimated peak of each layout of this world size, smallest first (parameters counted
    from shapes, `tp_fsdp_state_bytes`, the rest as for the planned layout, a frozen copy the
    objective holds all run long added; under a pipeline the larger of its first and last stage's
    ranks); and the best one."""
    spec = spec_for_args(args)
    with torch.device("meta"):
        plain = spec.build(args)
        base = spec.build(args) if options.lora is not None else plain  # a frozen reference's shape
    if options.lora is not None:  # the frozen base and its adapters, as parallelize makes them
        prepare_experts(spec, plain, lora=options.lora)
        apply_lora(plain, options.lora)
    frozen = objective.frozen(cfg)
    copy = frozen is not None and frozen.mode == "copy" and not frozen.precompute  # held all run
    if copy and frozen.model_args is not None:  # another model (a teacher): its own shape
        other = frozen.model_args(cfg)
        with torch.device("meta"):
            base = spec_for_args(other).build(other)
    stages = TableStages(plain)
    results = []
    for dims in candidate_layouts(cfg, args, current.world_size):
        shape = step_shape(cfg, args, dims, objective.rows_per_sample)
        if dims.pp == 1:
            state = tp_fsdp_state_bytes(plain, dims.tp, shape.fsdp)
            reference = tp_fsdp_state_bytes(base, dims.tp, shape.fsdp)[0] if copy else 0
            results.append((estimate_memory(plain, shape, state).peak + reference, dims))
            continue
        layout = pipeline_layout(cfg, args, dims)
        peaks = []
        for pp_rank in edge_pp_ranks(dims.pp):
            held = stages.of(layout, pp_rank)
            state = tp_fsdp_state_bytes(held, dims.tp, shape.fsdp)
            stage_shape = pipeline_step_shape(shape, layout, held, stages.group(dims.pp), pp_rank)
            peaks.append(estimate_memory(held, stage_shape, state).peak + (state[0] if copy else 0))
        results.append((max(peaks), dims))
    results.sort(key=lambda r: r[0])
    scale, unit = (GIB, "GiB") if results[-1][0] >= GIB else (1024**2, "MiB")
    with_ep = any(dims.ep > 1 for _, dims in results)
    lines = [f"layouts of {current.world_size} ranks (dp_replicate {current.dp_replicate}), by estimated peak:",
             f"  {'pp':>4} {'dp_shard':>8} {'cp':>4} {'tp':>4}" + (f" {'ep':>4}" if with_ep else "")
             + f" {'peak ' + unit:>9}" + ("  fits" if limit else "")]
    def row(peak: int, dims: ParallelDims) -> str:
        mark = ("  yes" if peak <= limit * GIB else "  no") if limit else ""
        here = "   <- this run" if _degrees(dims) == _degrees(current) else ""
        ep = f" {dims.ep:>4}" if with_ep else ""
        return f"  {dims.pp:>4} {dims.dp_shard:>8} {dims.cp:>4} {dims.tp:>4}{ep} {peak / scale:9.2f}{mark}{here}"

    lines += [row(peak, dims) for peak, dims in results[:rows]]
    if len(results) > rows:
        lines.append(f"  ({len(results) - rows} more, with larger peaks)")
        lines += [row(peak, dims) for peak, dims in results[rows:] if _degrees(dims) == _degrees(current)]
    return "\n".join(lines), results[0]


class TableStages:
    """The pipeline stages of the plain meta model, as each pipeline rank of a layout holds them,
    and a pipeline group of each size (on the dry run's fake process group), each made once."""

    def __init__(self, plain: nn.Module):
        self.plain = plain
        self._stages: dict[tuple, PipelineStages] = {}
        self._groups: dict[int, object] = {}

    def of(self, layout: PipelineLayout, pp_rank: int) -> PipelineStages:
        ids = layout.stage_ids(pp_rank)
        key = (layout.n_stages, *ids)
        if key not in self._stages:
            split = split_model(self.plain, default_split(self.plain, layout.n_stages), ids)
            self._stages[key] = PipelineStages(split, ids, layout.n_stages, self.plain)
        return self._stages[key]

    def group(self, pp: int):
        if pp not in self._groups:
            self._groups[pp] = torch.distributed.new_group(list(range(pp)))
        return self._groups[pp]


def _degrees(dims: ParallelDims) -> tuple[int, int, int, int, int]:
    return dims.pp, dims.dp_shard, dims.cp, dims.tp, dims.ep


def _verdict(estimate: MemoryEstimate, limit: float | None, cfg: JobConfig, dims: ParallelDims,
             best: tuple[int, ParallelDims]) -> None:
    if limit is None:
        return
    peak = estimate.peak / GIB
    if peak <= limit:
        print(f"fits: estimated peak {peak:.2f} GiB per device ({estimate.peak_phase}) of {limit:g} GiB, "
              f"{limit - peak:.2f} GiB to spare")
        return
    raise ConfigError(
        f"job.dry_run_device_memory_gib = {cfg.job.dry_run_device_memory_gib}: does not fit: estimated peak "
        f"{peak:.2f} GiB per device ({estimate.peak_phase}) exceeds {limit:g} GiB by {peak - limit:.2f} GiB "
        f"(parameters {estimate.parameters / GIB:.2f}, gradients {estimate.gradients / GIB:.2f}, optimizer "
        f"{estimate.optimizer / GIB:.2f}, activations {estimate.activations / GIB:.2f} GiB) with "
        f"{dims.describe()}; " + (
            f"{_layout_text(best[1])} would need {best[0] / GIB:.2f} GiB"
            + (" and fits" if best[0] <= limit * GIB else f", so no layout of {dims.world_size} ranks fits "
               "(more ranks, activation checkpointing or a smaller batch)"))
    )


def _layout_text(dims: ParallelDims) -> str:
    return ((f"pp={dims.pp} " if dims.pp > 1 else "") + f"dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp}"
            + (f" ep={dims.ep}" if dims.ep > 1 else ""))


def _memory_limit(text: str) -> float | None:
    if not text:
        return None
    try:
        return device_memory_gib(text)
    except ValueError:
        raise ConfigError(f"job.dry_run_device_memory_gib: expected GiB (e.g. 80) or a GPU name (h100, a100-40gb, "
                          f"4090), got {text!r}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ac(cfg: JobConfig) -> str:
    ac = cfg.activation_checkpoint
    return f"selective {ac.selective_option}" if ac.mode == "selective" else ac.mode
