"""Materialise a (possibly parallelised) meta-device model and initialise its weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication


def materialize(model: nn.Module, device: torch.device | str, seed: int) -> nn.Module:
    """Allocate the model's parameters and buffers on `device`, then call `model.init_weights(seed)`.

    The model draws each parameter whole; `implicit_replication` lets that full tensor be copied
    into a DTensor parameter, each rank keeping its own slice. So whatever transforms came
    before, the weights equal those of a single-device model initialised with the same seed.
    Apply after all the transforms.
    """
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    _retie(model, shared)
    with implicit_replication():
        model.init_weights(seed=seed)
    return model


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered under more than one (module, name), e.g. tied embeddings:
    the places of each, in registration order."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [where for where in places.values() if len(where) > 1]


def _retie(model: nn.Module, shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group of places share one parameter again.

    `to_empty` allocates each module's parameters separately, so a parameter registered twice
    (the output projection tied to the token embedding) comes back as two independent tensors:
    the model would train two matrices and save values its tied export contradicts. The first
    place's new parameter is put in the other places."""
    for (first, first_name), *others in shared:
        param = first._parameters[first_name]
        for module, name in others:
            module._parameters[name] = param
