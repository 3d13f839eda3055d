"""Weight initialisation that does not depend on order or sharding: each parameter is drawn
whole from a generator of its own, seeded by (run seed, parameter name)."""

from __future__ import annotations

import zlib

import torch
from torch import nn


def param_seed(seed: int, name: str) -> int:
    """The seed of one parameter's own generator: a function of (seed, parameter name) only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def trunc_normal(shape, std: float, dtype, device, seed: int) -> torch.Tensor:
    """N(0, std²) truncated at ±3 std, drawn from a generator of its own."""
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.empty(shape, dtype=torch.float32, device=device)
    nn.init.trunc_normal_(values, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return values.to(dtype)
