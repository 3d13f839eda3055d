"""Llama hyper-parameters and the published flavors (Llama 2, Llama 3, 3.1, 3.2)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from weft.models.common.rotary import RopeScaling
from weft.models.common.shape_checks import check_heads


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many key/value heads as query heads (no GQA)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False  # output projection shares the token embedding matrix
    explicit_head_dim: int | None = None  # None: dim / n_heads (a Hugging Face config may set another)
    explicit_ffn_hidden_dim: int | None = None  # None: derived from ffn_dim_multiplier and multiple_of

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads if self.explicit_head_dim is None else self.explicit_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4·dim (to keep the FLOPs of a 4·dim MLP), scaled, rounded up;
        or explicit_ffn_hidden_dim when given."""
        if self.explicit_ffn_hidden_dim is not None:
            return self.explicit_ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def __post_init__(self) -> None:
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        check_heads(self.n_heads, self.kv_heads, self.head_dim)


_LLAMA2 = ModelArgs(vocab_size=32000, rope_theta=10000.0, max_seq_len=4096)
_LLAMA3 = ModelArgs(vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)
_LLAMA3_1 = replace(_LLAMA3, rope_scaling=RopeScaling(factor=8.0), max_seq_len=131072)
_LLAMA3_2 = replace(_LLAMA3, rope_scaling=RopeScaling(factor=32.0), max_seq_len=131072, tie_embeddings=True)

# fmt: off
LLAMA_FLAVORS: dict[str, ModelArgs] = {
    # Tiny Llama-3-shaped model (grouped-query attention, 2 query heads per key/value head)
    # for CPU runs and tests. The vocabulary matches the shipped Shakespeare tokenizer.
    "debugmodel": replace(_LLAMA3, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048,
                          multiple_of=64, max_seq_len=2048),
    "llama2_7b":  replace(_LLAMA2, dim=4096, n_layers=32, n_heads=32),
    "llama2_13b": replace(_LLAMA2, dim=5120, n_layers=40, n_heads=40),
    "llama2_70b": replace(_LLAMA2, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                          ffn_dim_multiplier=1.3, multiple_of=4096),
    # Llama 3.2 (1B, 3B): tied embeddings, rope scaling factor 32.
    "llama3_1b":  replace(_LLAMA3_2, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                          ffn_dim_multiplier=1.5, multiple_of=256),
    "llama3_3b":  replace(_LLAMA3_2, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                          ffn_dim_multiplier=1.0, multiple_of=256),
    # Llama 3.1 (8B, 70B, 405B): 128K context through rope scaling factor 8.
    "llama3_8b":  replace(_LLAMA3_1, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          ffn_dim_multiplier=1.3, multiple_of=1024),
    "llama3_70b": replace(_LLAMA3_1, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                          ffn_dim_multiplier=1.3, multiple_of=4096),
    "llama3_405b": replace(_LLAMA3_1, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                           ffn_dim_multiplier=1.2, multiple_of=4096),
}
# fmt: on
