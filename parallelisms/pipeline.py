"""Pipeline parallelism: cut a model into stages, place them on the ranks of the pp mesh, and run
them under one of torch.distributed.pipelining's schedules.

A stage is a deep copy of the (meta-device) model with the modules it does not own deleted, so
it keeps the full model's parameter names (`layers.3.attention.wq.weight` stays that on every
layout): `materialize` seeds each weight by its name and draws the same values as one device,
and checkpoints from any layout line up. Each stage then goes through `parallelize` like a whole
model. The schedules are torch's own (`get_schedule_class`); this module only decides which
stages a rank holds and checks, before anything starts, what a schedule will refuse.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _ComputationType,
    get_schedule_class,
)

from weft.errors import Conflict, TransformError
from weft.parallelisms.hf_stages import HFCausalLMStage, hf_causal_lm_units
from weft.parallelisms.parallel_dims import LayoutError

logger = logging.getLogger("weft")

# Schedules whose ranks hold their two stages in V order (rank r: stages r and 2·pp-1-r), so the
# first and last stage share a rank; the other multi-stage schedules place stages in loop order.
V_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)
# Schedules that split each backward into an input-gradient and a later weight-gradient part.
SPLIT_BACKWARD_SCHEDULES = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass(frozen=True)
class PipelineOptions:
    """For `parallelize`: the model is one pipeline stage, run by this torch schedule."""

    schedule: str = "1F1B"  # a torch.distributed.pipelining schedule's name


def check_stage_composes(quantize_base: str | None) -> None:
    """A pipeline stage cannot hold an NF4 base: QLoRA quantizes the whole model's real weights one
    unit at a time before FSDP, which stages built apart do not do, so their base would stay unquantized."""
    if quantize_base:
        raise TransformError("parallelize", "pipeline", "does not support pipeline parallelism; use FSDP, HSDP, "
                             "context parallelism or one device, or LoRA without quantize_base",
                             Conflict("QLoRA", "apply_lora", "quantize_base", quantize_base))


def schedule_class(schedule: str) -> type:
    """torch's schedule class of that name (as `get_schedule_class` spells them: "1F1B", "ZBVZeroBubble")."""
    return get_schedule_class(schedule)


def is_multi_stage(schedule: str) -> bool:
    """Whether the schedule runs several stages per rank."""
    return issubclass(schedule_class(schedule), PipelineScheduleMulti)


def splits_backward(schedule: str) -> bool:
    return issubclass(schedule_class(schedule), SPLIT_BACKWARD_SCHEDULES)


def stages_per_rank(schedule: str, requested: int = 0) -> int:
    """Stages each rank holds: `requested`, or 0 for the schedule's own need (1, or 2 for the
    multi-stage schedules). A count the schedule cannot run is a LayoutError."""
    multi, v_shape = is_multi_stage(schedule), issubclass(schedule_class(schedule), V_SCHEDULES)
    count = requested or (2 if multi else 1)
    if not multi and count != 1:
        raise LayoutError(f"parallelism.pp_schedule = {schedule} runs one stage per rank; "
                          f"parallelism.pp_stages_per_rank = {count} needs a multi-stage schedule such as Interleaved1F1B")
    if multi and count < 2:
        raise LayoutError(f"parallelism.pp_schedule = {schedule} runs several stages per rank; "
                          f"parallelism.pp_stages_per_rank = {count} gives one (use 2 or more, or 1F1B / GPipe)")
    if v_shape and count != 2:
        raise LayoutError(f"parallelism.pp_schedule = {schedule} runs exactly 2 stages per rank (V order); "
                          f"got parallelism.pp_stages_per_rank = {count}")
    return count


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages rank `pp_rank` of `pp` holds: in loop order (r, r+pp, r+2·pp, ...), or for the
    V schedules r and 2·pp-1-r, so one rank holds both the first and the last stage."""
    if issubclass(schedule_class(schedule), V_SCHEDULES):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def check_microbatches(schedule: str, microbatches: int, local_batch_size: int, n_stages: int, pp: int) -> None:
    """Refuse, before anything starts, a micro-batch count the schedule would reject (LayoutError)."""
    if local_batch_size % microbatches:
        raise LayoutError(f"parallelism.pp_microbatches = {microbatches} does not divide "
                          f"training.local_batch_size = {local_batch_size}")
    cls = schedule_class(schedule)
    needs = n_stages if cls.__name__ in ("Schedule1F1B", "ScheduleDualPipeV") else 1
    if microbatches < needs:
        raise LayoutError(f"parallelism.pp_schedule = {schedule} needs at least as many micro-batches as stages "
                          f"({n_stages}); got parallelism.pp_microbatches = {microbatches}")
    if issubclass(cls, (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise LayoutError(f"parallelism.pp_schedule = {schedule} runs micro-batches in rounds of pp = {pp}: "
                              f"parallelism.pp_microbatches = {microbatches} is not a multiple of its "
                              f"{rounds} rounds")


@dataclass(frozen=True)
class PipelineLayout:
    """How a run pipelines: the schedule, pp ranks with stages_per_rank stages each, and the
    micro-batches each local batch is cut into."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_ids(self, pp_rank: int) -> list[int]:
        return stage_ids(self.schedule, pp_rank, self.pp, self.stages_per_rank)

    def describe(self) -> str:
        return (f"pipeline: {self.schedule} schedule, {self.n_stages} stages over pp {self.pp} "
                f"({self.stages_per_rank} per rank), {self.microbatches} micro-batches per local batch")


def plan_pipeline(*, schedule: str, pp: int, stages_per_rank_requested: int, microbatches: int,
                  local_batch_size: int, n_blocks: int, tied_embeddings: bool,
                  model: str = "the model") -> PipelineLayout:
    """Check a pipeline layout against the schedule and the model (`model` names it in messages)
    before anything starts (LayoutError, one line naming the key). microbatches 0: one per sample
    of the local batch."""
    per_rank = stages_per_rank(schedule, stages_per_rank_requested)
    n_stages = pp * per_rank
    if n_stages > n_blocks:
        raise LayoutError(f"parallelism.pp = {pp} × {per_rank} stages per rank = {n_stages} stages, more than the "
                          f"model's {n_blocks} blocks")
    if tied_embeddings:
        raise LayoutError(f"parallelism.pp = {pp}: {model} ties its output projection to the token embedding, "
                          "which the first and the last pipeline stage cannot share; use a flavor with untied "
                          "embeddings or parallelism.pp = 1")
    microbatches = microbatches or local_batch_size
    check_microbatches(schedule, microbatches, local_batch_size, n_stages, pp)
    return PipelineLayout(schedule, pp, per_rank, microbatches)


def pipeline_units(model: nn.Module) -> list[list[str]]:
    """The model as a sequence of units a split may not cut: the token embedding, each block, and
    the final norm with the output projection. Known for a model that declares them
    (`model.pipeline_units()`: weft's models) and transformers' *ForCausalLM
    (parallelisms/hf_stages.py); other models pass module names per stage."""
    if callable(declared := getattr(model, "pipeline_units", None)):
        return declared()
    if (units := hf_causal_lm_units(model)) is not None:
        return units
    raise LayoutError(f"pipeline: no default split for {type(model).__name__}; pass module names per stage")


def default_split(model: nn.Module, n_stages: int) -> list[list[str]]:
    """Module names per stage: the embedding first, the norm and output last, the blocks spread so
    that every stage holds about as many units, counting the embedding and the norm with the
    output as one block each (they cost about as much memory as one); earlier stages take the
    remainder."""
    units = pipeline_units(model)
    n_blocks = len(units) - 2
    if n_stages > n_blocks:
        raise LayoutError(f"pipeline: {n_stages} stages (pp × pp_stages_per_rank) for a model of {n_blocks} blocks; "
                          "use at most one stage per block")
    per_stage, extra = divmod(len(units), n_stages)
    split, start = [], 0
    for stage in range(n_stages):
        count = per_stage + (stage < extra)
        split.append([name for unit in units[start:start + count] for name in unit])
        start += count
    return split


def split_model(model: nn.Module, module_names_per_stage: Sequence[Sequence[str]],
                stages: Sequence[int] | None = None) -> list[nn.Module]:
    """Stage modules: for each stage index in `stages` (default all), a deep copy of `model` without
    the modules that other stages own. Modules no stage names (rotary tables, say) stay in every
    stage. A list of blocks becomes a dict keyed by the original indices, so parameter names are
    the full model's. Use on a meta-device model (the copies then cost no memory). A transformers
    *ForCausalLM's stages come wrapped in `HFCausalLMStage`, whose forward runs just its part."""
    owner: dict[str, int] = {}
    known = dict(model.named_modules())
    for stage, names in enumerate(module_names_per_stage):
        for name in names:
            if name not in known:
                raise LayoutError(f"pipeline: stage {stage} names {name!r}, which is not a module of {type(model).__name__}")
            if name in owner:
                raise LayoutError(f"pipeline: {name!r} is named by stages {owner[name]} and {stage}")
            owner[name] = stage
    result = []
    for stage in range(len(module_names_per_stage)) if stages is None else stages:
        part = copy.deepcopy(model)
        for name in sorted((n for n, s in owner.items() if s != stage), key=lambda n: -n.count(".")):
            _delete_module(part, name)
        result.append(HFCausalLMStage(part) if hf_causal_lm_units(model) is not None else part)
    return result


def _delete_module(model: nn.Module, name: str) -> None:
    """Remove model.<name>: a dict entry is deleted, a list becomes a dict first (keeping
    indices as keys), any other attribute becomes None (the model's forward skips it)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, nn.ModuleList):
        grand_name, _, attr = parent_name.rpartition(".")
        grand = model.get_submodule(grand_name) if grand_name else model
        parent = nn.ModuleDict({str(i): m for i, m in enumerate(parent)})
        setattr(grand, attr, parent)
    if isinstance(parent, nn.ModuleDict):
        del parent[child]
    else:
        setattr(parent, child, None)


class _Stage(PipelineStage):
    """torch's PipelineStage that calls `after_metadata_inference(module)` once torch's metadata
    inference is done: before the first step, torch runs one real forward and backward of a
    micro-batch through every stage to learn the shapes between them, and state a forward
    accumulates (an MoE layer's token counts) must not keep what that run added."""

    def __init__(self, *args, after_metadata_inference: Callable[[nn.Module], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.after_metadata_inference = after_metadata_inference

    def _post_metadata_inference_cleanup(self) -> None:  # torch's own cleanup of that run (FSDP, grads)
        super()._post_metadata_inference_cleanup()
        self.after_metadata_inference(self.submod)


def build_schedule(stage_modules: Sequence[nn.Module], ids: Sequence[int], n_stages: int, *, schedule: str,
                   microbatches: int, loss_fn: Callable, device: torch.device, pp_group,
                   after_metadata_inference: Callable[[nn.Module], None] = lambda stage: None) -> object:
    """torch's schedule over this rank's stages (already parallelised and materialised).

    loss_fn(output, target) gives each micro-batch's loss as it should enter backward: the
    schedule does not rescale gradients (scale_grads=False), so a loss already normalised by the
    global batch's token count gives the gradients of one big batch. after_metadata_inference(stage)
    undoes what torch's shape-finding run before the first step left in a stage (see `_Stage`)."""
    stages = [_Stage(module, stage_index, n_stages, device, group=pp_group,
                     after_metadata_inference=after_metadata_inference)
              for module, stage_index in zip(stage_modules, ids)]
    cls = schedule_class(schedule)
    if issubclass(cls, PipelineScheduleMulti):
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass(frozen=True)
class InFlight:
    """What a pipeline rank holds at most under its schedule, in micro-batches of its blocks."""

    blocks: int  # block activations (one block, one micro-batch each) held at the peak
    blocks_with_gradients: int  # held at the peak after the first backward, beside the gradients
    logits: int  # micro-batches the last stage has run forward and not yet backward (0 without it)


def activations_in_flight(layout: PipelineLayout, pp_rank: int, pp_group, blocks_per_stage: dict[int, int]) -> InFlight:
    """Count along torch's own order of the rank's actions: a forward of a stage adds a micro-batch
    of its blocks' activations, a full or input backward frees it. Builds the schedule over
    placeholder stages; sends nothing."""

    ids = layout.stage_ids(pp_rank)
    schedule = build_schedule([nn.Identity() for _ in ids], ids, layout.n_stages, schedule=layout.schedule,
                              microbatches=layout.microbatches, loss_fn=None, device=torch.device("cpu"),
                              pp_group=pp_group)
    order = schedule.pipeline_order if isinstance(schedule, PipelineScheduleMulti) else schedule._get_pipeline_order()
    last = layout.n_stages - 1
    held = logits = peak = peak_after = peak_logits = 0
    backward_seen = False
    for action in order[pp_rank]:
        if action is None or action.stage_index not in blocks_per_stage:
            continue
        weight = blocks_per_stage[action.stage_index]
        if action.computation_type == _ComputationType.FORWARD:
            held += weight
            logits += action.stage_index == last
        elif action.computation_type in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT):
            held -= weight
            logits -= action.stage_index == last
            backward_seen = True
        peak, peak_logits = max(peak, held), max(peak_logits, logits)
        if backward_seen:
            peak_after = max(peak_after, held)
    return InFlight(peak, peak_after, peak_logits)


class PipelineStages(nn.ModuleList):
    """The stages one rank holds, in its schedule's order, as one module for the optimizer, the
    checkpoint and train/eval mode. Parameter names inside each stage are the full model's."""

    def __init__(self, modules: Sequence[nn.Module], ids: Sequence[int], n_stages: int, whole: nn.Module,
                 pp_group=None):
        super().__init__(modules)
        self.stage_ids = list(ids)
        self.n_stages = n_stages
        self.pp_group = pp_group  # the process group of the pipeline ranks
        self._whole = (whole,)  # in a tuple: not a submodule, its (meta) parameters are not this rank's

    @property
    def whole_model(self) -> nn.Module:
        """The unsplit model the stages were cut from, on the meta device: what a checkpoint of
        any layout holds."""
        return self._whole[0]

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids
