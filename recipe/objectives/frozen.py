"""A frozen model an objective holds beside the one it trains: preference's reference, a teacher.

Either the trained model itself with its LoRA adapters switched off (no second copy), or a frozen
copy built by the trained model's own path (meta -> parallelize -> materialize, so sharded like it),
without LoRA or gradients, never in a checkpoint (it is read again at every start). The objective
asks it for one value per row of each micro-batch (`rows(logits, labels)`); `precompute` computes
those of the whole run in a first pass, after which the copy is freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from weft.components.data import Batch, batches
from weft.components.training.moe_balance import reset_expert_counts
from weft.models import spec_for_args
from weft.parallelisms.lora import adapters_off
from weft.parallelisms.pipeline import build_schedule
from weft.recipe.build import build_model, load_initial_weights, loader_factory
from weft.recipe.step import PipelineLoss, StepSetup, place, stage_kwargs

logger = logging.getLogger("weft")

Rows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits, labels -> one value per row


@dataclass(frozen=True)
class Frozen:
    """What an objective asks for: `name` (its log lines: 'preference reference', 'distillation teacher'), `mode`
    ('adapters_off': the trained model with its adapters off; 'copy'), the copy's weights from `path`
    (the config key `path_key`; empty: the run's starting weights), and whether to `precompute`
    (the config key `precompute_key`)."""

    name: str
    mode: str
    path: str = ""
    path_key: str = ""
    precompute: bool = False
    precompute_key: str = ""
    model_args: Callable | None = None  # cfg -> another model's shape (a teacher's); None: the trained model's

    def source(self, plan) -> str:
        """Where the copy's weights come from: `path`, else the run's starting weights
        (checkpoint.initial_load_path, the seed checkpoint step-0); '' for the seeded initialisation,
        which the copy draws as the trained model did."""
        cfg = plan.cfg
        if self.path or cfg.checkpoint.initial_load_path:
            return self.path or cfg.checkpoint.initial_load_path
        seed = Path(cfg.job.dump_folder) / cfg.checkpoint.folder / "step-0"
        return str(seed) if cfg.checkpoint.enable and seed.is_dir() else ""

    def build(self, plan, setup: StepSetup, meshes, device: torch.device, rows: Rows) -> Callable[[Batch], torch.Tensor]:
        """batch -> the frozen model's `rows` of a placed batch, without gradients."""
        if self.mode == "adapters_off":
            logger.info(f"{self.name}: the policy with its LoRA adapters switched off")
            return functools.partial(_policy_rows, setup, rows)
        return functools.partial(row_values, self.copy(plan, meshes, device, rows), setup, rows)

    def copy(self, plan, meshes, device: torch.device | None, rows: Rows | None = None) -> nn.Module:
        """The frozen copy, built as the policy is but without LoRA (of `model_args`'s model where it
        names another: `other_model`); on meta for device None (the dry run)."""
        if self.model_args is not None:
            plan = other_model(plan, self.model_args(plan.cfg))
            if meshes is not None and plan.dims.ep < meshes.dims.ep:  # a dense model under expert parallelism
                meshes = dataclasses.replace(meshes, dims=plan.dims, ep=None, expert_fsdp=None)
        options = dataclasses.replace(plan.options, lora=None)
        model = build_model(dataclasses.replace(plan, options=options), meshes, device)
        if device is None:
            return model
        if plan.pipeline is not None:  # its own schedule, forward only, each row's value its loss
            loss = PipelineLoss(fn=rows)
            model.schedule = (build_schedule(model, model.stage_ids, model.n_stages, schedule=plan.pipeline.schedule,
                                             microbatches=plan.pipeline.microbatches, loss_fn=loss, device=device,
                                             pp_group=meshes.pp.get_group(),
                                             after_metadata_inference=reset_expert_counts), loss)
        source = self.source(plan)
        if source:
            key = self.path_key if self.path else "checkpoint.initial_load_path"
            load_initial_weights(model, Path(source), key=key)
        model.requires_grad_(False)
        logger.info(f"{self.name}: a frozen copy of the model from {source or 'the seeded initialisation'}")
        return model.eval()

    def precompute_run(self, plan, run, start_step: int, of: Callable[[Batch], torch.Tensor],
                       what: str) -> tuple[Precomputed, Precomputed]:
        """`of` each micro-batch the run will train on from `start_step` (a loader of its own, from the
        training loader's state) and of the validation batches, computed now, to be handed out in
        order; the caller then drops the frozen model (`free_memory`). Before the first step the
        optimizer holds no state yet: this pass needs the two models' weights and one forward's activations."""
        cfg = plan.cfg
        loader = loader_factory(plan, run.meshes)(cfg.data.format, plan.data_files)
        loader.load_state_dict(run.loader.state_dict())
        micro_batches = (cfg.training.steps - start_step) * cfg.training.gradient_accumulation_steps
        train = [of(place(run.step, b)).cpu() for _, b in zip(range(micro_batches), batches(loader))]
        validation = []
        if "" in run.validation_loaders:
            steps = cfg.validation.steps * cfg.training.gradient_accumulation_steps
            validation = [of(place(run.step, b)).cpu()
                          for _, b in zip(range(steps), batches(run.validation_loaders[""]()))]
        logger.info(f"{self.name}: its {what} of {len(train)} training and {len(validation)} validation "
                    "micro-batches precomputed; the frozen model is dropped")
        key = self.precompute_key
        return Precomputed(train, key=key), Precomputed(validation, key=key, cycle=True)


def other_model(plan, args):
    """The trained model's plan for the model of `args` (a teacher of another family or size): its own spec,
    the same layout and transforms but float8; a dense model under expert parallelism takes no ep (its FSDP
    spans the same ranks)."""
    spec = spec_for_args(args)
    dims = plan.dims if spec.experts(args) is not None else dataclasses.replace(plan.dims, ep=1)
    return dataclasses.replace(plan, spec=spec, model_args=args, dims=dims,
                               options=dataclasses.replace(plan.options, float8=None))


def _policy_rows(setup: StepSetup, rows: Rows, batch: Batch) -> torch.Tensor:
    """The policy with its adapters off, in eval mode: MoE layers neither count these tokens for the
    routing balance nor add their load-balancing loss."""
    training = setup.model.training
    setup.model.eval()
    try:
        return row_values(setup.model, setup, rows, batch, context=adapters_off)
    finally:
        setup.model.train(training)


@torch.no_grad()
def row_values(model: nn.Module, setup: StepSetup, rows: Rows, batch: Batch, context=contextlib.nullcontext) -> torch.Tensor:
    """`model`'s `rows` of a placed batch (this rank's part of each row under cp), inside `context`
    (LoRA's adapters_off, for the policy as its own reference); under pp through a schedule (the
    policy's, its loss switched to rows, or a frozen copy's `schedule`), on every pipeline rank."""
    if setup.pipeline is None:
        with context(setup.model), setup.loss_context():
            with setup.forward_context():
                logits = setup.forward(model, batch)
            return rows(logits, batch.labels)
    schedule, loss_fn = (setup.pipeline.schedule, setup.pipeline.loss) if model is setup.model else model.schedule
    values: list[torch.Tensor] = []
    previous, loss_fn.fn = loss_fn.fn, rows
    try:
        with context(setup.model), setup.loss_context(), setup.forward_context():
            schedule.eval(batch.inputs, target=batch.labels, losses=values, **stage_kwargs(batch))
    finally:
        loss_fn.fn = previous
    values = torch.cat(values) if values else torch.zeros(batch.labels.shape[0], device=setup.device)
    torch.distributed.all_reduce(values, group=setup.pipeline.group)  # zero on ranks without the last stage
    return values


def free_memory(device: torch.device) -> None:
    """What a dropped frozen model held, given back (to the CUDA allocator's pool too)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Precomputed:
    """Values per row computed ahead, handed out in the order the batches come (`cycle`: again from
    the first after the last, as each validation reads the same batches)."""

    def __init__(self, rows: list[torch.Tensor], *, key: str, cycle: bool = False) -> None:
        self.rows, self.key, self.cycle, self.next = rows, key, cycle, 0

    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.next == len(self.rows):
            if not self.cycle:
                raise RuntimeError(f"{self.key}: more batches than the first pass computed")
            self.next = 0
        values = self.rows[self.next]
        self.rows[self.next] = None if not self.cycle else values  # a training batch's are needed once
        self.next += 1
        if values.shape[0] != batch.labels.shape[0]:
            raise RuntimeError(f"{self.key}: a batch's rows differ from the first pass's")
        return values.to(batch.labels.device)
