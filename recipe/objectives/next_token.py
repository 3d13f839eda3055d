"""Next-token training (pretraining, SFT): the mean token loss over the supervised tokens.

The loss of a step is the mean over the supervised tokens of the whole global batch: their
number is counted over all micro-batches and data/context-parallel ranks first, then each
micro-batch contributes its sum of token losses divided by it (components/training/loss.py), so
gradient accumulation and every layout give the same gradients as one big batch on one device.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from weft.components.data import Batch, batches
from weft.components.training.loss import IGNORE_INDEX, global_supervised_count, token_loss
from weft.recipe.objectives import Objective, register
from weft.recipe.step import StepSetup, pipeline_run, place


@register
class NextToken(Objective):
    """Each position predicts the next token: text windows, and chat or prompt/completion samples
    (labels only where the loss applies); validation: one mean loss per source."""

    name = "next_token"
    formats = default_for = ("text", "chat", "prompt_completion")

    def step(self, setup: StepSetup, micro_batches: list[Batch], on_phase) -> tuple[torch.Tensor, dict[str, float]]:
        supervised = global_supervised_count([batch.labels for batch in micro_batches], setup.loss_group)
        step_loss = torch.zeros((), device=setup.device)
        if setup.pipeline is not None:  # torch's schedule runs each micro-batch, forwards and backwards interleaved
            setup.pipeline.loss.fn = functools.partial(token_loss, global_count=supervised,
                                                       grad_ranks=setup.grad_ranks, compiled=setup.compiled_loss)
            on_phase("backward")
            return sum((pipeline_run(setup, batch, train=True) for batch in micro_batches), step_loss), {}
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
        return step_loss, {}

    def validate(self, run, cfg) -> tuple[dict[str, float], None]:
        """One loss per validation source (each of a mixture's), each over a fresh loader's first batches."""
        steps = cfg.validation.steps * cfg.training.gradient_accumulation_steps
        return {name: evaluate(run.step, make_loader(), steps, document_masking=cfg.data.document_masking)
                for name, make_loader in run.validation_loaders.items()}, None


@torch.no_grad()
def evaluate(setup: StepSetup, loader, steps: int, *, document_masking: bool) -> float:
    """Mean loss over the supervised tokens of the loader's first `steps` micro-batches.

    Runs in eval mode without gradients on a loader of its own, so the training data cursor
    and random state are untouched; sums and counts are reduced over data/context-parallel ranks,
    so every layout gets the same value."""
    setup.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=setup.device)
    count = torch.zeros((), dtype=torch.float64, device=setup.device)
    if setup.pipeline is not None:  # sums of token losses
        setup.pipeline.loss.fn = functools.partial(token_loss, global_count=1.0, grad_ranks=1,
                                                   compiled=setup.compiled_loss)
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
