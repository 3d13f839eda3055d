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
    model.to_empty(device=device)
    with implicit_replication():
        model.init_weights(seed=seed)
    return model
