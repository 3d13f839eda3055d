"""Pipeline stages of a transformers decoder-only `*ForCausalLM` (`model.embed_tokens`,
`model.layers`, `model.norm`, `lm_head`): the units a split may not cut and the forward of one stage.

weft's own models run as stages as they are (their forward skips the modules a stage does not
hold; their units come from their `ModelSpec`). A transformers model does not, so each of its
stages is wrapped in `HFCausalLMStage`, which keeps the attribute names `model` and `lm_head`:
parameter names stay the full model's (`model.layers.3.self_attn.q_proj.weight`), and so do the
names `apply_tp`'s plan, `fully_shard`, `materialize` and checkpoints match.
"""

from __future__ import annotations

import torch
from torch import nn


def hf_causal_lm_units(model: nn.Module) -> list[list[str]] | None:
    """A transformers decoder-only *ForCausalLM (`model.embed_tokens`, `model.layers`, `model.norm`,
    `lm_head`) as units, or None if `model` is not one."""
    inner = getattr(model, "model", None)
    if inner is None or not (hasattr(inner, "embed_tokens") and hasattr(inner, "layers")):
        return None
    keys = inner.layers.keys() if isinstance(inner.layers, nn.ModuleDict) else range(len(inner.layers))
    return [["model.embed_tokens"], *([f"model.layers.{key}"] for key in keys), ["model.norm", "lm_head"]]


class HFCausalLMStage(nn.Module):
    """One pipeline stage of a transformers *ForCausalLM: token ids in on the first stage, hidden
    states between stages, logits out of the last. Packed documents are told apart by their
    positions, which restart at each (transformers' packed-sequence mask); document_ids add nothing.

    Every stage computes the rotary embeddings of its positions (`model.rotary_emb` is in each)
    and the causal mask with transformers' own `create_causal_mask`, as the whole model's forward
    does, so any attention implementation of the config gets the mask it expects."""

    def __init__(self, part: nn.Module):
        super().__init__()
        self.model = part.model  # held under the unsplit model's names
        self.lm_head = part.lm_head
        self.config = part.config
        self._hf_init_weights = part._init_weights  # the model's own, so that `materialize` initialises a stage

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' initialisation of one module (the rotary tables' buffers included)."""
        self._hf_init_weights(module)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if document_ids is not None and positions is None:
            raise ValueError("HFCausalLMStage: packed documents (document_ids) need their positions, restarting at "
                             "each document, from which transformers builds its packed-sequence mask")
        inner = self.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = positions if positions is not None else torch.arange(h.shape[1], device=h.device)[None]
        rotary = inner.rotary_emb(h, position_ids=position_ids)
        mask = create_causal_mask(config=inner.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        for layer in inner.layers.values() if isinstance(inner.layers, nn.ModuleDict) else inner.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
        if inner.norm is not None:
            h = inner.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h
