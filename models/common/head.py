"""A decoder's final hidden states handed, with a way to project rows of them to logits, to a loss that
wants neither model's logits whole (on-policy distillation: components/training/distillation.py). The
rows are called inside the model's forward, so FSDP holds the head unsharded and tensor parallelism's
output style splits the vocabulary as it does for the logits."""

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
    """`use(hidden, project)` from inside a weft decoder's forward, in place of its logits. Under
    sequence parallelism every rank takes the whole sequence's hidden states (their gradient summed back
    by DTensor). Without gradient (a frozen teacher) `project` multiplies by the head's weight gathered
    once, so it may be called after the forward, whatever FSDP reshards."""

    def hook(h: torch.Tensor, output: nn.Module) -> object:
        if not torch.is_grad_enabled():
            weight = output.weight.full_tensor() if isinstance(output.weight, DTensor) else output.weight
            h = h.full_tensor() if isinstance(h, DTensor) else h
            return use(h, lambda rows: F.linear(rows, weight.detach()))
        if not isinstance(h, DTensor):
            return use(h, output)
        mesh, replicate = h.device_mesh, [Replicate()] * h.device_mesh.ndim
        whole = h.redistribute(placements=replicate).to_local()
        return use(whole, lambda rows: output(DTensor.from_local(rows, mesh, replicate, run_check=False)))

    model.head_hook = hook
    try:
        return model(inputs, positions, document_ids=document_ids)
    finally:
        model.head_hook = None
