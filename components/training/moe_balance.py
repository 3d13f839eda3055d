"""Keeping a Mixture-of-Experts model's experts evenly loaded, and measuring how even they are.

Auxiliary-loss-free balancing (Wang et al., 2024; DeepSeek-V3): after every optimizer step each MoE
layer's `expert_bias` moves by `rate · sign(mean load − load)`, the loads summed over the ranks so
every rank routes alike. A layer's load imbalance is its busiest expert's tokens over the mean;
under expert parallelism the EP imbalance is the busiest rank's tokens over its EP group's mean,
the worst over the groups. `set_load_balance_loss` adds the load-balancing loss (docs/moe.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from weft.components.checkpoint.state import model_parts
from weft.models.common.moe import MoE


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers this rank holds (a pipeline rank: those of its stages), by the model's own
    names (`layers.1.feed_forward`, without activation checkpointing's wrapper): weft's MoE layers and
    the routers of a transformers model, which count their `tokens_per_expert` alike
    (models/transformers/routing.py)."""
    return [(name.replace("_checkpoint_wrapped_module.", ""), module) for part in model_parts(model)
            for name, module in part.named_modules()
            if isinstance(module, MoE) or isinstance(getattr(module, "tokens_per_expert", None), torch.Tensor)]


@torch.no_grad()
def balance_experts(model: nn.Module, rate: float, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Read and reset every MoE layer's token counts, summed over `group` (the ranks that route
    other tokens: data- and context-parallel, and tensor-parallel under ep with tp; None, one process); nudge each layer's bias by `rate` towards equal load
    (rate 0: no balancing; weft's MoE layers only); return each layer's load imbalance. One all-reduce for all layers."""
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([layer.tokens_per_expert for _, layer in layers])  # [layers, experts]
    if group is not None:
        dist.all_reduce(loads, group=group)
    mean = loads.mean(dim=-1, keepdim=True)
    for (_, layer), load, layer_mean in zip(layers, loads, mean):
        if rate and isinstance(layer, MoE):  # a transformers router's choice is left as it is
            layer.expert_bias += rate * torch.sign(layer_mean - load)
        layer.tokens_per_expert.zero_()
    imbalance = loads.max(dim=-1).values / mean.squeeze(-1).clamp(min=1e-9)
    return {name: value for (name, _), value in zip(layers, imbalance.tolist())}


@torch.no_grad()
def ep_imbalance(model: nn.Module, ep_group: dist.ProcessGroup, group: dist.ProcessGroup) -> dict[str, float]:
    """Each MoE layer's EP imbalance this step (see the module), read before `balance_experts`
    resets the counts: the counts summed over `ep_group` (the expert-parallel ranks, of which rank
    r holds experts r·E/ep … (r+1)·E/ep − 1), then the worst over `group` (the ranks whose routing
    counts balance_experts sums, so that all log the same). Two all-reduces of [layers, experts]."""
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([layer.tokens_per_expert for _, layer in layers])  # [layers, experts]
    dist.all_reduce(loads, group=ep_group)
    received = loads.view(len(layers), dist.get_world_size(ep_group), -1).sum(-1)  # [layers, ep ranks]
    imbalance = received.max(-1).values / received.mean(-1).clamp(min=1e-9)
    dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=group)
    return {name: value for (name, _), value in zip(layers, imbalance.tolist())}


@torch.no_grad()
def reset_expert_counts(model: nn.Module) -> None:
    """Forget the token counts of every MoE layer in `model` (forwards that were not the step's:
    torch's pipeline metadata inference)."""
    for _, layer in moe_layers(model):
        layer.tokens_per_expert.zero_()


def set_load_balance_loss(model: nn.Module, coeff: float, accumulation_steps: int = 1) -> None:
    """Every MoE layer adds coeff · its load-balancing loss to the training loss's gradient, as a
    mean over the step's `accumulation_steps` micro-batches (each layer adds it once per forward)."""
    for _, layer in moe_layers(model):
        if isinstance(layer, MoE):
            layer.load_balance_coeff = coeff / accumulation_steps
