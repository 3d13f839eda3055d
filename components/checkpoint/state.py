"""Model and optimizer state dicts keyed by the full model's parameter names, for a whole model or
for the pipeline stages one rank holds.

A pipeline rank's stages sit in one container (`parallelisms.pipeline.PipelineStages`, a list of
modules marked by `stage_ids`), and torch's state-dict functions would prefix every name with the
stage's place in that list ("0.layers.3..."). Each stage keeps the full model's names, so these
functions take the state of each stage as it is: checkpoints of every layout, with or without a
pipeline, then hold the same keys and DCP reshards between them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def model_parts(model: nn.Module) -> list[nn.Module]:
    """A pipeline rank's stages, else [model]."""
    return list(model) if hasattr(model, "stage_ids") else [model]


def whole_model(model: nn.Module) -> nn.Module:
    """The model a checkpoint of it holds: a pipeline rank's stages stand for the unsplit model."""
    return getattr(model, "whole_model", model)


def model_state(model: nn.Module, options: StateDictOptions | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for part in model_parts(model):
        state.update(get_model_state_dict(part, options=options))
    return state


def load_model_state(model: nn.Module, state: dict[str, Any], *, strict: bool = True) -> None:
    for part in model_parts(model):
        own = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: v for k, v in state.items() if k in own}, options=StateDictOptions(strict=strict))


def full_tensors(model: nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for each named tensor of the model's state, one at a time, on every rank
    (each rank must iterate them all: they gather collectively). A sharded tensor is gathered over
    its mesh, an NF4 one dequantized; under a pipeline the stage holding it broadcasts it over the
    pipeline ranks, which first exchange who holds what (shapes and dtypes included)."""
    state = {name: t for part in model_parts(model) for name, t in get_model_state_dict(part).items()}
    pp_group = getattr(model, "pp_group", None)
    owners: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
    if pp_group is not None:  # who holds each tensor, its shape and dtype (LoRA's are not in the whole meta model)
        held: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(held, {name: (t.shape, t.dtype) for name, t in state.items()}, group=pp_group)
        owners = {name: (rank, *meta) for rank, rank_held in enumerate(held) for name, meta in rank_held.items()}
    device = next(model.parameters()).device
    for name in names:
        tensor = state.get(name)
        if tensor is not None:
            tensor = _whole(tensor)
        if pp_group is not None:
            owner, shape, dtype = owners[name]
            if tensor is None:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, group=pp_group, group_src=owner)
        yield name, tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A state tensor gathered whole; torchao's NF4Tensor (QLoRA's base) as the weight it holds.

    A sharded NF4 weight is dequantized where it lies and its plain shards gathered: gathering the
    NF4 shards themselves (three asynchronous gathers of its inner tensors) corrupted the heap under
    gloo within a few hundred gathers (torch 2.13, torchao 0.18), killing a rank mid-export. The
    values are the same either way: NF4's quantization blocks never cross a shard's rows."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if hasattr(local, "get_original_weight"):
            local = local.get_original_weight()
            tensor = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                        shape=tensor.shape, stride=tensor.stride())
        return tensor.full_tensor()
    tensor = tensor.detach()
    return tensor.get_original_weight() if hasattr(tensor, "get_original_weight") else tensor


def prefixed_names(model: nn.Module) -> dict[str, str]:
    """{full model name: name inside the stage container} of a pipeline rank's parameters."""
    if not hasattr(model, "stage_ids"):
        return {}
    return {name.split(".", 1)[1]: name for name, _ in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer) -> dict[str, Any]:
    state = get_optimizer_state_dict(model, optimizer)
    plain = {prefixed: name for name, prefixed in prefixed_names(model).items()}
    return _rename(state, plain) if plain else state


def load_optimizer_state(model: nn.Module, optimizer, state: dict[str, Any]) -> None:
    """Load `state` (as DCP filled it in) into the optimizer. Each group's hyperparameters come from
    the checkpoint, its parameters are the live optimizer's: a checkpoint's list of names is one
    rank's, which under a pipeline holds only its own stages' parameters."""
    prefixed = prefixed_names(model)
    if prefixed:  # this rank's parameters under their container names; other stages' entries dropped
        state = _rename(state, prefixed)
    name_of = {id(p): name for name, p in model.named_parameters()}
    groups = [dict(saved, params=[name_of[id(p)] for p in live["params"]])
              for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True)]
    set_optimizer_state_dict(model, optimizer, {"state": state["state"], "param_groups": groups})


def _rename(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The optimizer state dict with its parameter names mapped by `names`; others left out."""
    groups = [dict(group, params=[names[p] for p in group["params"] if p in names]) for group in state["param_groups"]]
    return {"state": {names[k]: v for k, v in state["state"].items() if k in names}, "param_groups": groups}
