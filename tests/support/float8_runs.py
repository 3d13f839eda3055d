"""A weft model with its linears in emulated float8 (or left in fp32) and a short training run, for
the float8 tests of each family: same initialisation, same batches, so the two runs compare."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def float8_model(model_class: type[nn.Module], args: Any, float8: str | None, monkeypatch) -> nn.Module:
    """`model_class(args)` through parallelize with float8 `recipe` (None: no float8), its
    Float8Linear matmuls emulated (tests/float8/test_float8.py says why), initialised with seed 0."""
    from weft.float8 import Float8Options
    from weft.float8 import float8 as float8_module
    from weft.parallelisms import ParallelizeOptions, parallelize
    from weft.parallelisms.fsdp import FSDPOptions
    from weft.parallelisms.materialize import materialize

    real = float8_module._float8_config
    monkeypatch.setattr(float8_module, "_float8_config", lambda *a: replace(real(*a), emulate=True))
    with torch.device("meta"):
        model = model_class(args)
    options = Float8Options(float8, filter_fqns=("output",), min_dim=16) if float8 else None
    parallelize(model, None, ParallelizeOptions(float8=options, fsdp=FSDPOptions(param_dtype=torch.float32)))
    materialize(model, "cpu", seed=0)
    return model


def train_losses(model: nn.Module, steps: int = 20) -> list[float]:
    """The loss of each of `steps` AdamW steps (lr 3e-3) on random 16-token-vocabulary batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 16, (4, 33), generator=generator)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out
