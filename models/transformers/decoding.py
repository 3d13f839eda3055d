"""How a transformers model generates (`Backend.decoding`): with the cache transformers' own code
makes (a DynamicCache, or the hybrid cache of a family with other layers), left padding told by the
2-D attention mask that grows with each step, and each row's positions as position_ids."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weft.models.common.spec import Decoding


@dataclass
class HFCache:
    """A batch's transformers cache (None until the prefill makes it) and the attention mask of every
    token fed so far ([batch, tokens], 0: padding or a stopped row's token)."""

    past_key_values: Any = None
    attention_mask: torch.Tensor | None = None


def start(model: nn.Module, batch: int, max_len: int) -> HFCache:
    """An empty cache: the model's first forward makes its own, as its `generate` would."""
    return HFCache()


def forward(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
            cache: HFCache) -> torch.Tensor:
    """Logits [batch, vocab] after the next tokens [batch, s], appended to the cache."""
    valid = valid.long()
    mask = valid if cache.attention_mask is None else torch.cat([cache.attention_mask, valid], dim=1)
    # transformers 5 names the cache `cache`; a folder's own code (trust_remote_code) may still say past_key_values
    plain = getattr(model, "_orig_mod", model)  # torch.compile's wrapper takes *args, **kwargs
    name = "cache" if "cache" in inspect.signature(plain.forward).parameters else "past_key_values"
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{name: cache.past_key_values})
    cache.past_key_values, cache.attention_mask = out[name], mask
    return out.logits[:, -1]


def finish(model: nn.Module, cache: HFCache) -> None:
    """Drop the cache."""
    cache.past_key_values = cache.attention_mask = None


TRANSFORMERS_DECODING = Decoding(start=start, forward=forward, finish=finish)
