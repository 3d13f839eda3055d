"""The transformers backend's `Backend.forward_head` (models/common/head.py): the decoder's final hidden
states, captured while the causal LM's forward computes only its last position's logits, and its head
repeated outside that forward: lm_head, then the family's logit scaling and soft-capping. Checked once per
model against its whole logits on a short row; a family whose logits are something else gets them whole.
A student's head is its own lm_head module (FSDP holds it unsharded until backward is done), a frozen
teacher's its weight, gathered once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from weft.models.common.head import Use, whole_sequence
from weft.models.transformers.model import forward


def forward_head(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None,
                 document_ids: torch.Tensor | None, use: Use) -> object:
    """`use(hidden, project)` of a transformers causal LM, or `use(logits, rows -> rows)` where its head
    is not lm_head plus a scale and soft-cap."""
    if not _head_repeats_logits(model, inputs, positions, document_ids):
        return use(forward(model, inputs, positions, document_ids), lambda rows: rows)
    return use(*_hidden_and_head(model, inputs, positions, document_ids))


def _hidden_and_head(model: nn.Module, inputs, positions, document_ids):
    captured = []

    def keep(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    hook = model.get_decoder().register_forward_hook(keep)
    try:
        forward(model, inputs, positions, document_ids, logits_to_keep=1)
    finally:
        hook.remove()
    hidden, head = captured[-1], model.get_output_embeddings()
    if torch.is_grad_enabled():  # lm_head called after the forward: FSDP's root held unsharded until backward
        if isinstance(model, FSDPModule):
            model.unshard()
        hidden, project = whole_sequence(hidden, head)
        return hidden, _scaled(model, project)
    hidden = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
    weight, bias = (None if p is None else (p.full_tensor() if isinstance(p, DTensor) else p).to(hidden.dtype)
                    for p in (head.weight, head.bias))
    return hidden, _scaled(model, lambda rows: F.linear(rows, weight, bias))


def _scaled(model: nn.Module, head):
    """`head` followed by what the causal LMs of transformers do to lm_head's output."""
    config = model.config.get_text_config()
    scale, divide = getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def project(rows: torch.Tensor) -> torch.Tensor:
        logits = head(rows)
        logits = logits * scale if scale is not None else logits  # Cohere
        logits = logits / divide if divide is not None else logits  # Granite
        return torch.tanh(logits / cap) * cap if cap is not None else logits  # Gemma 2 and 3

    return project


@torch.no_grad()
def _head_repeats_logits(model: nn.Module, inputs, positions, document_ids) -> bool:
    """Whether `_hidden_and_head` gives this model's logits: compared once, on the first row's first 8
    tokens, within a hundredth of their largest magnitude (the model computes in bf16 or fp32)."""
    if not hasattr(model, "weft_head_repeats_logits"):
        n = min(8, inputs.shape[1])
        where = None if positions is None else positions[:n] if positions.ndim == 1 else positions[:1, :n]
        short = (inputs[:1, :n], where, None if document_ids is None else document_ids[:1, :n])
        logits = forward(model, *short)
        logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
        try:
            hidden, project = _hidden_and_head(model, *short)
        except (TypeError, AttributeError):  # no logits_to_keep, or no decoder to hook
            model.weft_head_repeats_logits = False
        else:
            got = project(hidden.reshape(-1, hidden.shape[-1])).float().view_as(logits)
            model.weft_head_repeats_logits = bool((got - logits).abs().max() <= 1e-2 * logits.abs().max())
    return model.weft_head_repeats_logits
