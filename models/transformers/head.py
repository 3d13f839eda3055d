"""The transformers backend's `Backend.forward_head` (models/common/head.py): a frozen teacher's final
hidden states, with only the last position's logits computed by its forward, and its head repeated
outside: lm_head, then the family's logit scaling and soft-capping. A student, or a family whose logits
are something else (checked once per model on a short row), gets its logits whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from weft.models.common.head import Use
from weft.models.transformers.model import forward


def forward_head(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None,
                 document_ids: torch.Tensor | None, use: Use) -> object:
    """`use(hidden, project)` of a transformers causal LM; with gradient `use(logits, rows -> rows)`:
    transformers' forward computes them whole (docs/distillation.md)."""
    if torch.is_grad_enabled() or not _head_repeats_logits(model, inputs, positions, document_ids):
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
    hidden = captured[-1].full_tensor() if isinstance(captured[-1], DTensor) else captured[-1]
    head = model.get_output_embeddings()
    weight, bias = (p.full_tensor() if isinstance(p, DTensor) else p for p in (head.weight, head.bias))
    config = model.config.get_text_config()
    scale, divide = getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def project(rows: torch.Tensor) -> torch.Tensor:
        logits = F.linear(rows, weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype))
        logits = logits * scale if scale is not None else logits  # Cohere
        logits = logits / divide if divide is not None else logits  # Granite
        return torch.tanh(logits / cap) * cap if cap is not None else logits  # Gemma 2 and 3

    return hidden, project


def _head_repeats_logits(model: nn.Module, inputs, positions, document_ids) -> bool:
    """Whether `_hidden_and_head` gives this model's logits: compared once, on the first row's first 8
    tokens, within a hundredth of their largest magnitude (the teacher computes in bf16 or fp32)."""
    if not hasattr(model, "weft_head_repeats_logits"):
        n = min(8, inputs.shape[1])
        where = None if positions is None else positions[:n] if positions.ndim == 1 else positions[:1, :n]
        short = (inputs[:1, :n], where, None if document_ids is None else document_ids[:1, :n])
        logits = forward(model, *short).float()
        try:
            hidden, project = _hidden_and_head(model, *short)
        except (TypeError, AttributeError):  # no logits_to_keep, or no decoder to hook
            model.weft_head_repeats_logits = False
        else:
            got = project(hidden.reshape(-1, hidden.shape[-1])).float().view_as(logits)
            model.weft_head_repeats_logits = bool((got - logits).abs().max() <= 1e-2 * logits.abs().max())
    return model.weft_head_repeats_logits
