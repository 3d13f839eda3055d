"""One training step, importable: train.py, the benchmarks and the tests run this same function.

train_step places the micro-batches, lets the run's objective (recipe/objectives/: next-token,
preference, grpo, distillation) compute the step's loss and gradients from them, then clips, updates
and balances the experts; under pp each objective runs torch's schedule (pipeline_run, the setup's
PipelineStep).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from weft.components.data import Batch
from weft.components.training.loss import token_loss
from weft.components.training.moe_balance import balance_experts, ep_imbalance
from weft.components.training.optim import clip_grad_norm_
from weft.float8 import precompute_float8_scales
from weft.parallelisms.cp import shard_sequence
from weft.recipe.objectives import Objective


def model_forward(model: nn.Module, batch: Batch, call: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """The logits for every position of a batch: weft's models take (inputs, positions, document_ids=);
    `call(model, inputs, positions, document_ids)` calls another (its spec's `forward`: transformers')."""
    if call is not None:
        return call(model, batch.inputs, batch.positions, batch.document_ids)
    return model(batch.inputs, batch.positions, document_ids=batch.document_ids)


@dataclass
class PipelineLoss:
    """A pipeline schedule's loss_fn(logits, target): `fn`, set by the objective that runs the schedule
    (the schedule itself never rescales gradients)."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, target)


@dataclass
class PipelineStep:
    """Under pp: torch's schedule over this rank's stages, its loss_fn, and the pipeline ranks'
    group (the gradient norm and the loss are summed over it)."""

    schedule: object
    loss: PipelineLoss
    group: torch.distributed.ProcessGroup


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
    objective: Objective | None = None  # what each step computes (recipe/objectives/): build_step sets it

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
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's (preference: rewards, pair means)


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
    step_loss, metrics = setup.objective.step(setup, micro_batches, on_phase)
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
    return StepResult(step_loss, grad_norm, lr, imbalance, ranks, metrics)


def stage_kwargs(batch: Batch) -> dict[str, torch.Tensor]:
    """What every stage is given besides its input: the positions (and document ids) of its micro-batch;
    a stage without the embedding cannot tell them from its input, which is sequence-sharded under tp."""
    positions = batch.positions if batch.positions is not None else torch.arange(
        batch.inputs.shape[1], device=batch.inputs.device)
    kwargs = {"positions": positions.expand(batch.inputs.shape[0], -1) if positions.ndim == 1 else positions}
    if batch.document_ids is not None:
        kwargs["document_ids"] = batch.document_ids
    return kwargs


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
