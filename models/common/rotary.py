"""Rotary position embeddings (Su et al., 2021) with Llama 3.1 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 rotary frequency scaling (long-context extension)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Angular frequency of each pair of channels: theta^(-2i/head_dim), i < head_dim/2.

    With Llama 3.1 scaling, wavelengths longer than the original context are slowed down by
    `factor`, short ones are kept, and the band in between is interpolated smoothly.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated),
    )


def rope_rotations(args, device: torch.device | None = None) -> torch.Tensor:
    """e^(i · position · frequency), the rotation of every channel pair at every position < max_seq_len:
    complex64 [max_seq_len, head_dim/2] (angles computed in float64). `args` is any model's
    hyper-parameters with head_dim, rope_theta, rope_scaling and max_seq_len."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def apply_rotary_emb(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair (x[2i], x[2i+1]) of every head by its position's angle.

    Read as the complex number x[2i] + i·x[2i+1], a pair rotates by angle θ when multiplied by
    e^(iθ): one element-wise kernel, where the same rotation written with cos and sin takes four
    multiplies, two adds and a stack (and their backwards).
    x: [batch, seq, heads, head_dim]; rotations: [seq, head_dim/2] or [batch, seq, head_dim/2].
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotated = pairs * rotations.unsqueeze(-2)  # broadcast over heads
    return torch.view_as_real(rotated).flatten(-2).type_as(x)
