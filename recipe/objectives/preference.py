"""Preference training (data.format = preference): DPO, IPO, SimPO or ORPO on {prompt, chosen, rejected} pairs.

A pair is two rows of one batch (components/data/preference.py). Each pair's loss is divided by the
pairs of the global batch (ORPO adds the chosen answers' NLL over their tokens in the global batch),
so any layout or accumulation gives one big batch's gradients. The reference's log-probabilities
come from a frozen model (frozen.py): none for SimPO and ORPO; under LoRA without
preference.reference_path, the policy with its adapters switched off; else a frozen copy.
"""

from __future__ import annotations

import functools

import torch

from weft.components.config import ConfigError, JobConfig
from weft.components.data import Batch, batches
from weft.components.training.loss import IGNORE_INDEX
from weft.components.training.preference import (
    METRICS,
    REFERENCE_FREE,
    PreferenceOptions,
    answer_logps,
    micro_batch_loss,
    nll_tokens,
    pair_losses,
    sum_over_ranks,
)
from weft.recipe.objectives import Objective, register
from weft.recipe.objectives.frozen import Frozen, free_memory, row_values
from weft.recipe.step import StepSetup, pipeline_run, place


def _row_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return answer_logps(logits, labels)[0]


@register
class Preference(Objective):
    """The pairs' objective of [preference]; its metrics are TRL's rewards and log-probabilities (METRICS)."""

    name = "preference"
    formats = default_for = ("preference",)
    section = "preference"
    rows_per_sample = 2

    def __init__(self, options: PreferenceOptions, cp_group=None, reference=None) -> None:
        self.options, self.cp_group = options, cp_group  # under cp: a row's tokens are spread over cp_group
        self.reference = reference  # batch -> its rows' reference log-probabilities (None: reference-free)
        self.validation_reference = None  # precomputed: the validation batches'

    @classmethod
    def check(cls, cfg: JobConfig, dims) -> None:
        """The pairs' formats, the reference, and the layouts the objective supports."""
        p, validation = cfg.preference, cfg.validation.format or cfg.data.format
        if cfg.validation.enable and validation not in cls.formats:
            raise ConfigError(f"validation.format = {validation}: a preference run validates on pairs; set "
                              "validation.format = preference (or leave it empty)")
        if cfg.data.mixture:
            raise ConfigError("data.mixture: mixes windows of text or samples, and data.format = preference trains on "
                              "pairs; give one data.dataset_path")
        if p.loss in REFERENCE_FREE and p.precompute_reference:
            raise ConfigError(f"preference.precompute_reference: preference.loss = {p.loss} uses no reference model; "
                              "leave it false or use loss = sigmoid or ipo")
        if p.precompute_reference and cfg.fault_tolerance.enable:
            raise ConfigError("preference.precompute_reference: a fault-tolerant run retries steps, which a "
                              "precomputed sequence of reference batches cannot follow; leave it false")
        if p.loss in REFERENCE_FREE and p.reference_path:
            raise ConfigError(f"preference.reference_path: preference.loss = {p.loss} uses no reference model; "
                              "leave reference_path empty or use loss = sigmoid or ipo")

    @classmethod
    def frozen(cls, cfg: JobConfig) -> Frozen | None:
        """The reference: none for SimPO and ORPO; the policy with its adapters off under LoRA without
        preference.reference_path; else a frozen copy."""
        p = cfg.preference
        if p.loss in REFERENCE_FREE:
            return None
        mode = "adapters_off" if cfg.lora.enable and not p.reference_path else "copy"
        return Frozen("preference reference", mode, p.reference_path, "preference.reference_path",
                      p.precompute_reference, "preference.precompute_reference")

    @classmethod
    def describe_rows(cls, rows: int) -> str:
        return f"{rows // 2} pairs ({rows} rows)"

    @classmethod
    def build(cls, plan, setup: StepSetup, meshes, device: torch.device) -> Preference:
        p = plan.cfg.preference
        options = PreferenceOptions(loss=p.loss, beta=p.beta, label_smoothing=p.label_smoothing, gamma=p.gamma)
        objective = cls(options, cp_group=meshes.cp.get_group() if plan.dims.cp > 1 else None)
        frozen = cls.frozen(plan.cfg)
        if frozen is not None:
            rows = frozen.build(plan, setup, meshes, device, _row_logps)
            objective.reference = lambda batch: sum_over_ranks(rows(batch), objective.cp_group)
        return objective

    def prepare(self, plan, run, start_step: int) -> None:
        """preference.precompute_reference: the reference's log-probabilities of every micro-batch to
        come, computed now; the reference is then dropped, so training holds no copy of it."""
        frozen = self.frozen(plan.cfg)
        if frozen is None or not frozen.precompute:
            return
        self.reference, self.validation_reference = frozen.precompute_run(plan, run, start_step, self.reference,
                                                                          "log-probabilities")
        free_memory(run.device)

    def pairs_loss(self, logits: torch.Tensor, labels: torch.Tensor, row_labels: torch.Tensor,
                   reference: torch.Tensor | None, pairs: torch.Tensor, chosen_tokens: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch's share of the step's objective (before the grad_ranks scale) and its metrics
        (components/training/preference.py: micro_batch_loss; ORPO's NLL over the chosen rows whole)."""
        return micro_batch_loss(self.options, logits, labels, row_labels, reference, pairs, chosen_tokens,
                                self.cp_group)

    def step(self, setup: StepSetup, micro_batches: list[Batch], on_phase) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of the pairs' objective over the micro-batches. Returns this rank's share
        of the loss and the metrics' means over the global batch's pairs."""
        group, cp = setup.loss_group, self.cp
        counts = torch.stack([
            torch.tensor(float(sum(b.labels.shape[0] // 2 for b in micro_batches)), device=setup.device),
            sum(nll_tokens(b.row_labels) for b in micro_batches).float()])
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        pairs, chosen_tokens = counts[0] / cp, counts[1].clamp(min=1)  # pairs: each cp rank counted them
        step_loss = torch.zeros((), device=setup.device)
        sums = torch.zeros(len(METRICS), device=setup.device)
        if setup.pipeline is not None:  # the schedule's loss_fn computes the objective on the last stage
            setup.pipeline.loss.fn = functools.partial(self._pipeline_loss, pairs=pairs, chosen_tokens=chosen_tokens,
                                                       grad_ranks=setup.grad_ranks, sums=sums)
            for batch in micro_batches:
                reference = self.reference(batch) if self.reference is not None else None
                on_phase("backward")
                step_loss += pipeline_run(setup, batch, train=True, target=pack_pairs(batch, reference)) / cp
            torch.distributed.all_reduce(sums, group=setup.pipeline.group)  # zero on ranks without the last stage
        for batch in micro_batches if setup.pipeline is None else []:
            reference = self.reference(batch) if self.reference is not None else None
            with setup.loss_context():
                with setup.forward_context():
                    logits = setup.forward(setup.model, batch)
                loss, metrics = self.pairs_loss(logits, batch.labels, batch.row_labels, reference, pairs, chosen_tokens)
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

    def _pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor, *, pairs, chosen_tokens, grad_ranks: int,
                       sums: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on targets from `pack_pairs`, its metrics' sums added to `sums`."""
        labels, row_labels, reference = unpack_pairs(target)
        loss, metrics = self.pairs_loss(logits, labels, row_labels, reference, pairs, chosen_tokens)
        sums += torch.stack([metrics[name].sum() for name in METRICS])
        return loss * grad_ranks

    @property
    def cp(self) -> int:
        return 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)

    def log_note(self, metrics: dict[str, float]) -> str:
        return f"  reward_margin {metrics['rewards/margins']:.4f}  reward_accuracy {metrics['rewards/accuracies']:.3f}"

    def validate(self, run, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
        """The objective on the validation pairs, and its rewards."""
        steps = cfg.validation.steps * cfg.training.gradient_accumulation_steps
        metrics = self.evaluate(run.step, run.validation_loaders[""](), steps)
        return {"": metrics.pop("loss")}, metrics

    @torch.no_grad()
    def evaluate(self, setup: StepSetup, loader, steps: int) -> dict[str, float]:
        """The objective and its metrics (METRICS) as means over the pairs of the loader's first
        `steps` micro-batches, in eval mode without gradients; every layout gets the same values."""
        setup.model.eval()
        sums = torch.zeros(len(METRICS) + 4, dtype=torch.float64, device=setup.device)  # + loss, NLL, its tokens, pairs
        reference_of = self.validation_reference or self.reference
        for _, batch in zip(range(steps), batches(loader)):
            batch = place(setup, batch)
            reference = reference_of(batch) if reference_of is not None else None
            logps = sum_over_ranks(row_values(setup.model, setup, _row_logps, batch), self.cp_group)  # the policy's
            tokens = sum_over_ranks((batch.labels != IGNORE_INDEX).sum(-1), self.cp_group)
            losses, metrics = pair_losses(self.options, logps, tokens, reference)
            nll = torch.zeros(2, device=setup.device)
            if self.options.loss == "orpo":  # the chosen rows' NLL, whole: the policy's log-probabilities of row_labels
                whole = row_values(setup.model, setup, _row_logps, batch._replace(labels=batch.row_labels))
                nll = torch.stack([-sum_over_ranks(whole, self.cp_group)[0::2].sum(),
                                   sum_over_ranks(nll_tokens(batch.row_labels), self.cp_group).float()])
            sums += torch.stack([*(metrics[name].sum() for name in METRICS), losses.sum(), *nll,
                                 torch.tensor(float(losses.numel()), device=setup.device)]).double()
        if setup.loss_group is not None:
            torch.distributed.all_reduce(sums, group=setup.loss_group)
        setup.model.train()
        means = (sums[:len(METRICS) + 1] / sums[-1].clamp(min=1)).tolist()
        loss = means[-1] + (sums[-3] / sums[-2].clamp(min=1)).item()  # ORPO: its NLL over the chosen rows' tokens
        return {"loss": loss, **dict(zip(METRICS, means[:-1]))}


def pack_pairs(batch: Batch, reference: torch.Tensor | None) -> torch.Tensor:
    """The labels, the row labels and each row's reference log-probability (fp64 bits) as one more
    column: the target a pipeline schedule splits into micro-batches, so a row's reference travels with it."""
    labels = batch.labels
    bits = (reference if reference is not None else torch.zeros(labels.shape[0], device=labels.device))
    return torch.cat([labels, batch.row_labels, bits.double().view(torch.int64)[:, None]], dim=1)


def unpack_pairs(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = (target.shape[1] - 1) // 2
    return target[:, :width], target[:, width:-1], target[:, -1].contiguous().view(torch.float64).float()
