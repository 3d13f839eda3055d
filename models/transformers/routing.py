"""Tokens per routed expert of a transformers MoE model, for weft's routing metrics: a forward hook
on each of its routers (the module transformers records `router_logits` from) adds up the experts of
its top-k choice, in training, into a `tokens_per_expert` buffer, where weft's own MoE layers keep
theirs (components/training/moe_balance.py reads both). The router's outputs are left as they are.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("weft")


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers: modules of the class transformers records router_logits from (its
    `_can_record_outputs`, read from the model or, for a pipeline stage, the decoder it holds); none
    for a dense model."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        router_class = getattr(recorder, "target_class", recorder)
        if isinstance(router_class, type):
            return [router for router in model.modules() if isinstance(router, router_class)]
    return []


def count_routed_tokens(model: nn.Module, device: torch.device | str) -> None:
    """Each router of `model` counts, in training, the tokens its top-k choice sends to each expert
    (`tokens_per_expert` on `device`, not saved in checkpoints)."""
    for router in routers(model):
        weight = getattr(router, "weight", None)
        if weight is None or weight.ndim != 2:
            continue
        router.register_buffer("tokens_per_expert", torch.zeros(weight.shape[0], device=device), persistent=False)
        router._weft_routing_hook = router.register_forward_hook(_count)


@torch.no_grad()
def _count(router: nn.Module, args: tuple, output) -> None:
    """Adds the experts of the router's choice, its output's last element (logits, weights, top-k
    indices: transformers' routers' convention); a router whose output is otherwise stops counting."""
    if not router.training:  # the step's tokens, not validation's
        return
    indices = output[-1] if isinstance(output, tuple) and len(output) == 3 else None
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point():
        logger.warning(f"routing metrics: {type(router).__name__} does not return (logits, weights, top-k "
                       "indices); its tokens per expert are not counted")
        router._weft_routing_hook.remove()
        del router.tokens_per_expert
        return
    counts = router.tokens_per_expert
    counts.index_add_(0, indices.reshape(-1).to(counts.device), torch.ones(indices.numel(), device=counts.device))
