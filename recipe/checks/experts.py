"""Expert parallelism's checks; what the model's family refuses of a layout (its spec's
`refusals.layout`), with the tensor-parallel plan it declares checked on meta; and the transformers
backend's experts made ready for ep, tp and LoRA."""

from __future__ import annotations

import functools

import torch
from torch import nn

from weft.components.config import ConfigError, JobConfig
from weft.models import ModelSpec
from weft.parallelisms.common import TransformError
from weft.parallelisms.lora import LoRAOptions, names_routed_experts
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.tp import check_tp_plan
from weft.recipe.config_keys import model_source


def check_expert_parallel(cfg: JobConfig, spec: ModelSpec, args, dims: ParallelDims) -> None:
    """Expert parallelism needs experts to spread, as many on each rank, and (so far) no
    dp_replicate: one line naming the key otherwise (the ranks it borrows: ParallelDims)."""
    if dims.ep == 1:
        return
    experts = spec.experts(args)
    if experts is None:
        raise ConfigError(f"parallelism.ep = {dims.ep}: {model_source(cfg)} has no experts to spread; set parallelism.ep = 1")
    if experts.n_experts % dims.ep:
        raise ConfigError(f"parallelism.ep = {dims.ep} does not divide the {experts.n_experts} experts of {model_source(cfg)}; "
                          "each rank holds as many experts as the others")
    if dims.dp_replicate > 1:
        raise ConfigError(f"parallelism.ep = {dims.ep}: expert parallelism composes with dp_shard, cp, tp and pp so "
                          f"far, not parallelism.dp_replicate = {dims.dp_replicate}")
    if cfg.compile.enable:
        raise ConfigError(f"parallelism.ep = {dims.ep}: the all-to-all's split sizes are read on the host, which "
                          "compile cannot trace; set compile.enable = false")


def check_model_layout(cfg: JobConfig, spec: ModelSpec, args, dims: ParallelDims) -> None:
    """What the model's family cannot train in this layout with these transforms (the transformers
    backend's: models/transformers/refusals.py), a ConfigError naming the key."""
    refuse = spec.refusals.layout
    if refuse is None:
        return
    refusal = refuse(cfg, args, dims, adapts_experts=cfg.lora.enable and names_routed_experts(cfg.lora.target_modules),
                     tp_plan_refusal=lambda: tp_plan_refusal(spec, args, dims.tp))
    if refusal is not None:
        raise ConfigError(refusal)


def prepare_experts(spec: ModelSpec, model: nn.Module, *, ep: int = 1, tp: int = 1, lora: LoRAOptions | None = None) -> None:
    """Swap weft's grouped experts in for a transformers model's routed experts where a run needs
    them (models/transformers/experts.py): expert parallelism spreads them, tensor parallelism splits
    them by expert, and LoRA's adapters of routed experts go on them. Before `parallelize`, on the
    meta model."""
    prepare = spec.prepare_expert_parallel
    adapted = lora is not None and names_routed_experts(lora.target_modules)
    if prepare is not None and (ep > 1 or tp > 1 or adapted):
        prepare(model)


@functools.lru_cache(maxsize=8)
def tp_plan_refusal(spec: ModelSpec, args, tp: int) -> str | None:
    """Why apply_tp cannot split a transformers model over tp ranks by the plan it declares (a style
    it does not translate, experts or heads tp does not divide), from the model on meta as the
    recipe builds it; None where it can."""
    with torch.device("meta"):
        model = spec.build(args)
    prepare_experts(spec, model, tp=tp)
    try:
        check_tp_plan(model, tp)
    except TransformError as e:
        return str(e)
    return None
