"""Rotary position embeddings (Su et al., 2021) with Llama 3.1 frequency scaling, or YaRN's (Peng et
al., 2023; gpt-oss) with its attention factor."""

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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's rotary scaling (Peng et al., 2023): the slow channel pairs interpolated by `factor`,
    the fast ones kept, a linear ramp between the pair indices whose wavelengths turn `beta_fast`
    and `beta_slow` times over `original_max_seq_len`; queries and keys scaled by
    `attention_factor` (0.1·ln(factor) + 1 when None)."""

    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_seq_len: int = 4096
    truncate: bool = False  # round the ramp's ends outward to whole pair indices
    attention_factor: float | None = None

    @property
    def magnitude(self) -> float:
        """What each rotation multiplies a query or key by."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def yarn_frequencies(freqs: torch.Tensor, head_dim: int, theta: float, scaling: YarnScaling) -> torch.Tensor:
    """YaRN's blend of the frequencies `freqs` and those divided by `scaling.factor`."""

    def pair_index(turns: float) -> float:  # the pair whose wavelength fits `turns` times in the original context
        return head_dim * math.log(scaling.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None) -> torch.Tensor:
    """Angular frequency of each pair of channels: theta^(-2i/head_dim), i < head_dim/2.

    With Llama 3.1 scaling, wavelengths longer than the original context are slowed down by
    `factor`, short ones are kept, and the band in between is interpolated smoothly.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(freqs, head_dim, theta, scaling)
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
    hyper-parameters with head_dim, rope_theta, rope_scaling and max_seq_len. Under YaRN each rotation
    has the magnitude of its attention factor (a query and a key each scaled by it)."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    magnitude = args.rope_scaling.magnitude if isinstance(args.rope_scaling, YarnScaling) else 1.0
    return torch.polar(torch.full_like(angles, magnitude), angles).to(torch.complex64).to(device)


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
