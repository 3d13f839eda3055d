"""A decoder's final hidden states handed, with a way to project rows of them to logits, to a loss that
wants neither model's logits whole (on-policy distillation: components/training/distillation.py). With
gradient the rows are projected inside the model's forward, so FSDP holds the head unsharded and tensor
parallelism's output style splits the vocabulary as it does for the logits."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

# (final hidden states [B, T, D] as plain tensors, project: rows [n, D] -> logits [n, V]) -> the result
Use = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], object]


def forward_head(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None,
                 document_ids: torch.Tensor | None, use: Use) -> object:
    """`use(hidden, project)` in place of a weft decoder's logits. With gradient it runs inside the
    forward; under sequence parallelism every rank takes the whole sequence's hidden states (their
    gradient summed back by DTensor). Without (a frozen teacher) it runs after the forward, `project`
    multiplying by the head's weight as it is then, gathered if FSDP resharded it or tp split it."""
    frozen = not torch.is_grad_enabled()

    def hook(h: torch.Tensor, output: nn.Module) -> object:
        if frozen:
            return h.full_tensor() if isinstance(h, DTensor) else h
        return use(*whole_sequence(h, output))

    model.head_hook = hook
    try:
        result = model(inputs, positions, document_ids=document_ids)
    finally:
        model.head_hook = None
    if not frozen:
        return result
    weight = model.output.weight.detach()
    weight = (weight.full_tensor() if isinstance(weight, DTensor) else weight).to(result.dtype)
    return use(result, lambda rows: F.linear(rows, weight))


def whole_sequence(h: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]):
    """Hidden states as plain tensors and `head` taking rows of them: sequence-parallel ones (a DTensor)
    gathered so that every rank holds the whole sequence, their gradient summed back by DTensor, and
    each row handed to `head` as the replicated DTensor its tensor-parallel style expects."""
    if not isinstance(h, DTensor):
        return h, head
    mesh, replicate = h.device_mesh, [Replicate()] * h.device_mesh.ndim
    whole = h.redistribute(placements=replicate).to_local()
    return whole, lambda rows: head(DTensor.from_local(rows, mesh, replicate, run_check=False))
