"""One training step and one evaluation, importable: train.py, the benchmarks and the tests run
these same functions.

The loss of a step is the mean over the supervised tokens of the whole global batch: their
number is counted over all micro-batches and data/context-parallel ranks first, then each
micro-batch contributes its sum of token losses divided by it (components/training/loss.py), so
gradient accumulation and every layout give the same gradients as one big batch on one device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weft.components.data import Batch, batches
from weft.components.training.loss import IGNORE_INDEX, global_supervised_count, token_loss
from weft.components.training.moe_balance import balance_experts, ep_imbalance
from weft.components.training.optim import clip_grad_norm_
from weft.components.training.preference import (
    METRICS,
    PreferenceOptions,
    answer_logps,
    pair_losses,
    sum_over_ranks,
)
from weft.float8 import precompute_float8_scales
from weft.parallelisms.cp import shard_sequence


def model_forward(model: nn.Module, batch: Batch, call: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The logits for every position of a batch: weft's models take (inputs, positions, document_ids=);
    `call(model, inputs, positions, document_ids)` calls another (its spec's `forward`: transformers')."""
    if call is not None:
        return call(model, batch.inputs, batch.positions, batch.document_ids)
    return model(batch.inputs, batch.positions, document_ids=batch.document_ids)


@dataclass
class PipelineLoss:
    """A pipeline schedule's loss_fn(logits, labels): `token_loss` with the step's global supervised
    count, set before each schedule step (the schedule itself never rescales gradients). With
    `preference` set (a PreferenceStep), the pairs' objective on targets from `pack_pairs`, its
    metrics' sums added to `sums`; with `row_logps`, each row's answer log-probability (forward only)."""

    global_count: torch.Tensor | float = 1.0
    grad_ranks: int = 1
    compiled: bool = False
    preference: object = None
    chosen_tokens: torch.Tensor | float = 1.0  # ORPO's NLL: the chosen answers' tokens of the global batch
    sums: torch.Tensor | None = None
    row_logps: bool = False

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.row_logps:
            logps, _ = answer_logps(logits, labels)
            return logps
        if self.preference is None:
            return token_loss(logits, labels, self.global_count, self.grad_ranks, compiled=self.compiled)
        labels, reference = unpack_pairs(labels)
        loss, metrics = pairs_loss(self.preference, logits, labels, reference, self.global_count, self.chosen_tokens)
        self.sums += torch.stack([metrics[name].sum() for name in METRICS])
        return loss * self.grad_ranks


def pack_pairs(labels: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """The labels with each row's reference log-probability (fp64 bits) as one more column: the
    target a pipeline schedule splits into micro-batches, so a row's reference travels with it."""
    bits = (reference if reference is not None else torch.zeros(labels.shape[0], device=labels.device))
    return torch.cat([labels, bits.double().view(torch.int64)[:, None]], dim=1)


def unpack_pairs(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return target[:, :-1], target[:, -1].contiguous().view(torch.float64).float()


def pairs_loss(pref, logits: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor | None,
               pairs: torch.Tensor, chosen_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the step's objective (before the grad_ranks scale): its pairs' losses over
    the global batch's `pairs` (ORPO: plus its chosen answers' NLL over their global count), and its metrics."""
    logps, tokens = answer_logps(logits, labels)
    logps, tokens = sum_over_ranks(logps, pref.cp_group), sum_over_ranks(tokens, pref.cp_group)
    losses, metrics = pair_losses(pref.options, logps, tokens, reference if pref.options.needs_reference else None)
    loss = losses.sum() / pairs
    if pref.options.loss == "orpo":
        loss = loss - logps[0::2].sum() / chosen_tokens
    return loss, metrics


@dataclass
class PipelineStep:
    """Under pp: torch's schedule over this rank's stages, its loss_fn, and the pipeline ranks'
    group (the gradient norm and the loss are summed over it)."""

    schedule: object
    loss: PipelineLoss
    group: torch.distributed.ProcessGroup


@dataclass
class PreferenceStep:
    """Under data.format = preference: the objective, and each micro-batch's reference log-probabilities
    per row (`reference(batch)`, without gradients; None for a reference-free loss)."""

    options: PreferenceOptions
    reference: Callable[[Batch], torch.Tensor] | None = None
    cp_group: torch.distributed.ProcessGroup | None = None  # under cp: a row's tokens are spread over it
    validation_reference: Callable[[Batch], torch.Tensor] | None = None  # precomputed: the validation batches'

    @property
    def cp(self) -> int:
        return 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)


@dataclass
class StepSetup:
    """What every step needs, built once by `recipe.build.build_step`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    max_norm: float = 0.0
    loss_group: torch.distributed.ProcessGroup | None = None  # ranks whose losses are averaged: dp × cp
    grad_ranks: int = 1  # ranks over which gradients are averaged
    cp_mesh: object = None  # the context-parallel mesh, when cp > 1: batches are sharded along it
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # loss parallel
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # autocast
    compiled_loss: bool = False
    moe_bias_rate: float = 0.0  # MoE layers' routing bias step after each update (components/training/moe_balance.py)
    precompute_float8: bool = False  # one fused amax all-reduce after the update, for float8 all-gather
    forward: Callable[[nn.Module, Batch], torch.Tensor] = model_forward  # model, batch -> logits
    loss_fn: Callable[..., torch.Tensor] = token_loss  # as token_loss: logits, labels, count, grad_ranks, compiled=
    pipeline: PipelineStep | None = None  # under pp (model is then this rank's PipelineStages)
    ep_group: torch.distributed.ProcessGroup | None = None  # under ep: the ranks holding different experts
    routing_group: torch.distributed.ProcessGroup | None = None  # MoE routing counts summed: dp × cp (× tp under ep)
    # [fault_tolerance]: averages the gradients over the live replica groups before clipping (components/ft/groups.py)
    average_gradients: Callable[[list[nn.Parameter]], None] | None = None
    preference: PreferenceStep | None = None  # data.format = preference: the pairs' objective replaces token_loss

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean loss; all_reduce_mean over loss_group for the mean
    grad_norm: torch.Tensor
    lr: float  # the learning rate this step's update used
    moe_imbalance: dict[str, float] = field(default_factory=dict)  # each MoE layer's busiest expert / mean
    ep_imbalance: dict[str, float] = field(default_factory=dict)  # under ep: each layer's busiest rank / mean
    preference: dict[str, float] = field(default_factory=dict)  # rewards and log-probabilities (METRICS), pair means


def train_step(setup: StepSetup, micro_batches: list[Batch],
               on_phase: Callable[[str], None] = lambda phase: None,
               allow_update: Callable[[torch.Tensor, torch.Tensor], bool] = lambda grad_norm, loss: True) -> StepResult:
    """Forward and backward over the micro-batches, clip, update, advance the schedule, nudge the
    MoE layers' routing biases towards equal load (none without MoE layers).
    on_phase("forward" | "backward" | "step") is called as each phase begins (benchmarks/comm.py
    counts collectives per phase with it). allow_update(grad_norm, loss), asked after clipping,
    may leave out the update and the schedule's advance (components/training/nonfinite.py: a NaN step)."""
    on_phase("forward")
    setup.optimizer.zero_grad()
    micro_batches = [place(setup, batch) for batch in micro_batches]
    supervised = global_supervised_count([batch.labels for batch in micro_batches], setup.loss_group)
    step_loss = torch.zeros((), device=setup.device)
    rewards: dict[str, float] = {}
    if setup.preference is not None:
        step_loss, rewards = preference_step(setup, micro_batches, on_phase)
    elif setup.pipeline is not None:  # torch's schedule runs each micro-batch, forwards and backwards interleaved
        setup.pipeline.loss.global_count, setup.pipeline.loss.grad_ranks = supervised, setup.grad_ranks
        on_phase("backward")
        step_loss = sum((pipeline_run(setup, batch, train=True) for batch in micro_batches), step_loss)
    else:
        for batch in micro_batches:
            with setup.loss_context():
                with setup.forward_context():
                    logits = setup.forward(setup.model, batch)
                loss = setup.loss_fn(logits, batch.labels, supervised, setup.grad_ranks, compiled=setup.compiled_loss)
                del logits  # freed by backward, not held until the next forward
                on_phase("backward")
                loss.backward()
            step_loss += loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()
            on_phase("forward")
    on_phase("step")
    if setup.average_gradients is not None:
        setup.average_gradients(setup.trainable)
    grad_norm = clip_grad_norm_(setup.trainable, setup.max_norm, setup.pipeline.group if setup.pipeline else None)
    lr = setup.scheduler.get_last_lr()[0]  # read before the schedule moves on
    updated = allow_update(grad_norm, step_loss)
    if updated:
        setup.optimizer.step()
        setup.scheduler.step()
        if setup.precompute_float8:
            precompute_float8_scales(setup.model)
    ranks = ep_imbalance(setup.model, setup.ep_group, setup.routing_group) if setup.ep_group is not None else {}
    imbalance = balance_experts(setup.model, setup.moe_bias_rate if updated else 0.0, setup.routing_group)
    return StepResult(step_loss, grad_norm, lr, imbalance, ranks, rewards)


def preference_step(setup: StepSetup, micro_batches: list[Batch],
                    on_phase: Callable[[str], None]) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of the pairs' objective over the micro-batches: each pair's loss / the
    pairs of the global batch (ORPO adds the chosen answers' NLL / their tokens in the global batch),
    so any layout or accumulation gives one big batch's gradients. Returns this rank's share of the
    loss and the metrics' means over the global batch's pairs."""
    pref, group = setup.preference, setup.loss_group
    cp = pref.cp
    counts = torch.stack([torch.tensor(float(sum(b.labels.shape[0] // 2 for b in micro_batches)), device=setup.device),
                          sum((b.labels[0::2] != IGNORE_INDEX).sum() for b in micro_batches).float()])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    pairs, chosen_tokens = counts[0] / cp, counts[1].clamp(min=1)  # pairs: each cp rank counted them
    step_loss = torch.zeros((), device=setup.device)
    sums = torch.zeros(len(METRICS), device=setup.device)
    if setup.pipeline is not None:  # the schedule's loss_fn computes the objective on the last stage
        loss_fn = setup.pipeline.loss
        loss_fn.preference, loss_fn.global_count, loss_fn.chosen_tokens = pref, pairs, chosen_tokens
        loss_fn.grad_ranks, loss_fn.sums = setup.grad_ranks, sums
        try:
            for batch in micro_batches:
                reference = pref.reference(batch) if pref.reference is not None else None
                on_phase("backward")
                step_loss += pipeline_run(setup, batch, train=True, target=pack_pairs(batch.labels, reference)) / cp
        finally:
            loss_fn.preference = None
        torch.distributed.all_reduce(sums, group=setup.pipeline.group)  # zero on ranks without the last stage
    for batch in micro_batches if setup.pipeline is None else []:
        reference = pref.reference(batch) if pref.reference is not None else None
        with setup.loss_context():
            with setup.forward_context():
                logits = setup.forward(setup.model, batch)
            loss, metrics = pairs_loss(pref, logits, batch.labels, reference, pairs, chosen_tokens)
            del logits
        loss = loss * setup.grad_ranks
        on_phase("backward")
        loss.backward()
        step_loss += loss.detach() / cp
        sums += torch.stack([metrics[name].sum() for name in METRICS])
        on_phase("forward")
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    return step_loss, dict(zip(METRICS, (sums / (pairs * cp)).tolist()))


def cp_group_of(setup: StepSetup) -> torch.distributed.ProcessGroup | None:
    """The group a preference run's rows are spread over by context parallelism (None: whole rows)."""
    return None if setup.preference is None else setup.preference.cp_group


@torch.no_grad()
def reference_logps(model: nn.Module, setup: StepSetup, batch: Batch, context=contextlib.nullcontext) -> torch.Tensor:
    """`model`'s summed answer log-probabilities per row of a placed batch (summed over the cp ranks),
    inside `context` (LoRA's adapters_off, for the policy as its own reference); under pp through a
    schedule (the policy's, or a frozen copy's `schedule`), on every pipeline rank."""
    if setup.pipeline is not None:
        return pipeline_logps(setup, model, batch, context)
    with context(setup.model), setup.loss_context():
        with setup.forward_context():
            logits = setup.forward(model, batch)
        logps, _ = answer_logps(logits, batch.labels)
    return sum_over_ranks(logps, cp_group_of(setup))


class Precomputed:
    """Reference log-probabilities computed ahead, handed out in the order the batches come
    (`cycle`: again from the first after the last, as each validation reads the same batches)."""

    def __init__(self, rows: list[torch.Tensor], *, cycle: bool = False) -> None:
        self.rows, self.cycle, self.next = rows, cycle, 0

    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.next == len(self.rows):
            if not self.cycle:
                raise RuntimeError("preference.precompute_reference: more batches than the first pass computed")
            self.next = 0
        logps = self.rows[self.next]
        self.rows[self.next] = None if not self.cycle else logps  # a training batch's are needed once
        self.next += 1
        if logps.shape[0] != batch.labels.shape[0]:
            raise RuntimeError("preference.precompute_reference: a batch's rows differ from the first pass's")
        return logps.to(batch.labels.device)


@torch.no_grad()
def evaluate_preference(setup: StepSetup, loader, steps: int) -> dict[str, float]:
    """The objective and its metrics (METRICS) as means over the pairs of the loader's first
    `steps` micro-batches, in eval mode without gradients; every layout gets the same values."""
    pref = setup.preference
    setup.model.eval()
    sums = torch.zeros(len(METRICS) + 2, dtype=torch.float64, device=setup.device)  # + loss, pairs
    reference_of = pref.validation_reference or pref.reference
    for _, batch in zip(range(steps), batches(loader)):
        batch = place(setup, batch)
        reference = reference_of(batch) if reference_of is not None else None
        logps = reference_logps(setup.model, setup, batch)  # the policy's own, without gradients
        tokens = sum_over_ranks((batch.labels != IGNORE_INDEX).sum(-1), pref.cp_group)
        losses, metrics = pair_losses(pref.options, logps, tokens, reference)
        if pref.options.loss == "orpo":  # per pair: the chosen answer's mean NLL
            losses = losses - logps[0::2] / tokens[0::2].clamp(min=1)
        sums += torch.stack([*(metrics[name].sum() for name in METRICS), losses.sum(),
                             torch.tensor(float(losses.numel()), device=setup.device)]).double()
    if setup.loss_group is not None:
        torch.distributed.all_reduce(sums, group=setup.loss_group)
    setup.model.train()
    means = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
    return {"loss": means[-1], **dict(zip(METRICS, means[:-1]))}


@torch.no_grad()
def evaluate(setup: StepSetup, loader, steps: int, *, document_masking: bool) -> float:
    """Mean loss over the supervised tokens of the loader's first `steps` micro-batches.

    Runs in eval mode without gradients on a loader of its own, so the training data cursor
    and random state are untouched; sums and counts are reduced over data/context-parallel ranks,
    so every layout gets the same value."""
    setup.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=setup.device)
    count = torch.zeros((), dtype=torch.float64, device=setup.device)
    if setup.pipeline is not None:
        setup.pipeline.loss.global_count, setup.pipeline.loss.grad_ranks = 1.0, 1  # sums of token losses
    for _, batch in zip(range(steps), batches(loader, document_masking=document_masking)):
        batch = place(setup, batch)
        total += summed_loss(setup, batch).double()
        count += (batch.labels != IGNORE_INDEX).sum()
    if setup.loss_group is not None:
        both = torch.stack((total, count))
        torch.distributed.all_reduce(both, group=setup.loss_group)
        total, count = both[0], both[1]
    setup.model.train()
    return (total / count.clamp(min=1)).item()


def summed_loss(setup: StepSetup, batch: Batch) -> torch.Tensor:
    """The sum of the batch's token losses, forward only: through the pipeline schedule under pp
    (its loss_fn set to sum), else through the model."""
    if setup.pipeline is not None:
        return pipeline_run(setup, batch, train=False)
    with setup.loss_context():
        with setup.forward_context():
            logits = setup.forward(setup.model, batch)
        loss_sum = setup.loss_fn(logits, batch.labels, 1.0, compiled=setup.compiled_loss)
    return loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum


def stage_kwargs(batch: Batch) -> dict[str, torch.Tensor]:
    """What every stage is given besides its input: the positions (and document ids) of its micro-batch;
    a stage without the embedding cannot tell them from its input, which is sequence-sharded under tp."""
    positions = batch.positions if batch.positions is not None else torch.arange(
        batch.inputs.shape[1], device=batch.inputs.device)
    kwargs = {"positions": positions.expand(batch.inputs.shape[0], -1) if positions.ndim == 1 else positions}
    if batch.document_ids is not None:
        kwargs["document_ids"] = batch.document_ids
    return kwargs


def pipeline_logps(setup: StepSetup, stages: nn.Module, batch: Batch, context) -> torch.Tensor:
    """Each row's answer log-probability through a pipeline schedule, forward only (the policy's own,
    its loss switched to rows; a frozen copy's, `stages.schedule`), on every pipeline rank."""
    schedule, loss_fn = (setup.pipeline.schedule, setup.pipeline.loss) if stages is setup.model else stages.schedule
    losses: list[torch.Tensor] = []
    loss_fn.row_logps = True
    try:
        with context(setup.model), setup.loss_context(), setup.forward_context():
            schedule.eval(batch.inputs, target=batch.labels, losses=losses, **stage_kwargs(batch))
    finally:
        loss_fn.row_logps = stages is not setup.model
    logps = torch.cat(losses) if losses else torch.zeros(batch.labels.shape[0], device=setup.device)
    torch.distributed.all_reduce(logps, group=setup.pipeline.group)  # zero on ranks without the last stage
    return sum_over_ranks(logps, cp_group_of(setup))


def pipeline_run(setup: StepSetup, batch: Batch, *, train: bool, target: torch.Tensor | None = None) -> torch.Tensor:
    """One local batch through the pipeline schedule, forward and backward (train) or forward only;
    its loss summed over micro-batches, on every pipeline rank (the last stage computed it).
    `target`: what the loss reads (default: the labels)."""
    kwargs = stage_kwargs(batch)
    losses: list[torch.Tensor] = []
    with setup.loss_context():
        with setup.forward_context():
            run = setup.pipeline.schedule.step if train else setup.pipeline.schedule.eval
            extra = {"return_outputs": False} if train else {}
            run(batch.inputs, target=batch.labels if target is None else target, losses=losses, **extra, **kwargs)
    loss = torch.zeros((), device=setup.device)
    for part in losses:
        loss += (part.full_tensor() if isinstance(part, DTensor) else part).detach()
    torch.distributed.all_reduce(loss, group=setup.pipeline.group)  # zero on ranks without the last stage
    return loss


def place(setup: StepSetup, batch: Batch) -> Batch:
    """The batch on the step's device (a no-op for batches already there), this CP rank's shard under cp."""
    batch = batch.to(setup.device, non_blocking=True)
    return shard_batch(setup.cp_mesh, batch) if setup.cp_mesh is not None else batch


def shard_batch(cp_mesh, batch: Batch) -> Batch:
    """This CP rank's shard of every tensor of the batch. Positions: the documents' own if packed,
    else the global positions `shard_sequence` returns; document ids travel with the tokens."""
    present = [t for t in batch if t is not None]
    shards, global_positions = shard_sequence(cp_mesh, *present)
    shards = iter(shards)
    sharded = Batch(*(None if t is None else next(shards) for t in batch))
    return sharded if batch.positions is not None else sharded._replace(positions=global_positions)
