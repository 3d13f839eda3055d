"""AdamW (or Muon beside it: muon.py), the warmup-then-decay learning-rate schedule, and clipping by the
global gradient norm."""

from __future__ import annotations

import fnmatch
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from weft.components.config import LRScheduler, Optimizer
from weft.components.distributed.processes import shared_gloo_group
from weft.components.training.muon import Muon, head_blocks, muon_parameters
from weft.errors import UserError

logger = logging.getLogger("weft")

# Devices where torch's AdamW has a fused kernel: one kernel updates all of a parameter's state
# in a single pass, where foreach runs a dozen multi-tensor element-wise ops. CPU has had one
# since torch 2.4 (and has no multi-tensor foreach kernels: foreach there is a loop of per-tensor
# ops in C++), so "auto" picks fused on both; other devices (meta, for dry runs) get foreach.
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    """AdamW over every parameter (weight decay on all of them, as in the Llama papers); with
    optimizer.name Muon, Muon on the hidden matrices and AdamW on the rest (the split logged).

    optimizer.implementation "auto": fused where torch has the kernel (FUSED_ADAMW_DEVICES), else foreach;
    parameters mixing DTensors and plain tensors (a transformers model under TP alone, its norms
    left whole) take torch's per-parameter loop, as neither kernel takes both kinds at once.
    """
    if cfg.name == "Muon":
        return build_muon(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, **adamw_options(params, cfg))


def adamw_options(params: list[nn.Parameter], cfg: Optimizer) -> dict:
    """torch.optim.AdamW's keyword arguments for `params` from the [optimizer] section."""
    implementation = cfg.implementation
    if implementation == "auto" and len({isinstance(p, DTensor) for p in params}) > 1:
        implementation = "for-loop"
    elif implementation == "auto":
        implementation = "fused" if params and params[0].device.type in FUSED_ADAMW_DEVICES else "foreach"
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
            "fused": implementation == "fused", "foreach": implementation == "foreach"}


def build_muon(model: nn.Module, cfg: Optimizer) -> Muon:
    """Muon on muon_parameters(model)'s matrices, AdamW on the rest; the split logged."""
    params = dict(model.named_parameters())
    unmatched = unmatched_patterns(list(params), cfg.muon_exclude)
    if unmatched:
        raise UserError(f"optimizer.muon_exclude: {unmatched[0]!r} matches no parameter name (fnmatch against names "
                        f"such as {next(iter(params), '')!r}); expected a pattern naming the parameters left to AdamW")
    muon_names, adamw_names = muon_parameters(model, cfg.muon_exclude)
    if not muon_names:
        raise UserError("optimizer.name = Muon: no trainable matrix is left to Muon "
                        f"(optimizer.muon_exclude = {cfg.muon_exclude}); expected at least one")
    numel = sum(params[n].numel() for n in muon_names)
    logger.info(f"optimizer: Muon on {len(muon_names)} matrices ({numel:,} parameters, lr {cfg.muon_lr:g}), "
                f"AdamW on {len(adamw_names)} others (lr {cfg.lr:g}): {', '.join(adamw_names) or 'none'}")
    adamw = [params[n] for n in adamw_names]
    heads = head_blocks(model) if cfg.muon_per_head else {}
    if cfg.muon_per_head and not any(n in heads for n in muon_names):
        raise UserError("optimizer.muon_per_head: this model has no attention projections (wq, wk, wv, wo with a "
                        "head_dim) that Muon updates; expected weft's attention")
    return Muon([params[n] for n in muon_names], adamw, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, weight_decay=cfg.muon_weight_decay, ns_steps=cfg.muon_ns_steps,
                adjust_lr_fn=cfg.muon_adjust_lr, ns_dtype=getattr(torch, cfg.muon_ns_dtype),
                adamw=adamw_options(adamw, cfg), blocks={id(params[n]): heads[n] for n in muon_names if n in heads},
                owner_ranks=cfg.muon_owner_ranks)


def unmatched_patterns(names: list[str], patterns: list[str]) -> list[str]:
    """The `patterns` (fnmatch) that match none of `names` on any rank: a pipeline stage holds only
    its own parameters, so the ranks agree over a gloo group of them all (only if there are patterns)."""
    if not patterns:
        return []
    matched = torch.tensor([any(fnmatch.fnmatch(name, p) for name in names) for p in patterns], dtype=torch.int32)
    group = shared_gloo_group("optimizer")
    if group is not None:
        dist.all_reduce(matched, op=dist.ReduceOp.MAX, group=group)
    return [p for p, hit in zip(patterns, matched.tolist()) if not hit]


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float) -> float:
    """Fraction of the peak learning rate used by optimizer step `step` (0-based).

    Linear warmup reaches the peak on step warmup_steps - 1; then the rate decays, linearly or
    along a half cosine, towards min_lr_ratio · peak, reached just after the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        decay = 1.0 - progress
    elif decay_type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type: expected linear or cosine, got {decay_type!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    def multiplier(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_steps,
            decay_type=cfg.decay_type,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    return LambdaLR(optimizer, multiplier)


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (0: measure only); return the norm.

    With sharded (DTensor) gradients the local norms are partial; `full_tensor()` reduces them
    over every mesh dim the gradients are split on, so each rank sees the true global norm.
    pp_group: the pipeline ranks, each holding other stages' parameters: the squared norms of
    their stages are summed over it, so every stage clips by the whole model's norm.
    """
    # Gradients on different meshes (expert parallelism's experts beside FSDP's other parameters)
    # cannot meet in one foreach op: each mesh's norm is reduced alone, then the norms combined.
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values() or [[]]:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        squared = total_norm.double() ** 2
        dist.all_reduce(squared, group=pp_group)
        total_norm = squared.sqrt().to(total_norm.dtype)
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    return total_norm
