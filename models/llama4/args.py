"""Llama 4 hyper-parameters and the published flavors (Scout, Maverick) plus a CPU-sized MoE.

Names follow weft's Llama (`models/llama/args.py`) where the two models share an idea; the
Hugging Face `Llama4TextConfig` field each one mirrors is given beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from weft.models.common.rotary import RopeScaling
from weft.models.common.shape_checks import check_heads, check_top_k


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 5120  # hidden_size
    n_layers: int = 48  # num_hidden_layers
    n_heads: int = 40  # num_attention_heads
    n_kv_heads: int = 8  # num_key_value_heads
    explicit_head_dim: int | None = 128  # head_dim; None: dim / n_heads
    vocab_size: int = 202048
    norm_eps: float = 1e-5  # rms_norm_eps (also the epsilon of the query/key L2 norm)
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None  # rope_scaling of rope_type llama3
    max_seq_len: int = 131072  # positions the rotary table covers (max_position_embeddings, capped)
    tie_embeddings: bool = False
    dense_hidden_dim: int = 16384  # intermediate_size_mlp: SwiGLU width of the dense layers
    expert_hidden_dim: int = 8192  # intermediate_size: width of each routed and the shared expert
    n_experts: int = 16  # num_local_experts
    top_k: int = 1  # num_experts_per_tok
    moe_every: int = 1  # interleave_moe_layer_step: layers moe_every-1, 2·moe_every-1, ... are MoE
    nope_every: int = 4  # no_rope_layer_interval: layers nope_every-1, 2·nope_every-1, ... have no rotary
    attention_chunk_size: int | None = 8192  # rotary layers attend within chunks of this many positions
    qk_norm: bool = True  # use_qk_norm: L2-normalise queries and keys (rotary layers)
    temperature_tuning: bool = True  # attn_temperature_tuning: scale NoPE layers' queries with position
    floor_scale: int = 8192
    attn_scale: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads if self.explicit_head_dim is None else self.explicit_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The feed-forward width one token passes through, averaged over the layers: the dense
        SwiGLU's, or its top_k experts' and the shared expert's. What the memory estimate scales a
        block's feed-forward activations by (components/memory.py)."""
        moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        routed = (self.top_k + 1) * self.expert_hidden_dim
        return (moe * routed + (self.n_layers - moe) * self.dense_hidden_dim) // self.n_layers

    @property
    def routed_hidden_dim(self) -> int:
        """The routed experts' part of `ffn_hidden_dim` (top_k experts' width on the MoE layers,
        averaged over the layers): the part that follows the routing rather than the token."""
        moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        return moe * self.top_k * self.expert_hidden_dim // self.n_layers

    @property
    def routed_slots(self) -> float:
        """Expert slots one token fills in a block, averaged over the layers (top_k on MoE layers, 0
        on dense ones): the copies of its hidden state the routing makes."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers)) * self.top_k / self.n_layers

    def attended_context(self, layer: int, seq_len: int) -> int:
        """How many positions a query of `layer` can attend to at most in a sequence of `seq_len`:
        its chunk on rotary layers with chunked attention, the whole sequence otherwise."""
        if self.attention_chunk_size is not None and self.uses_rope(layer):
            return min(seq_len, self.attention_chunk_size)
        return seq_len

    def is_moe_layer(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % self.nope_every != 0

    def __post_init__(self) -> None:
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        check_top_k(self.top_k, self.n_experts)
        if self.moe_every < 1 or self.nope_every < 1:
            raise ValueError(f"moe_every {self.moe_every} and nope_every {self.nope_every} must be >= 1")


# Published text-model configs (config.json `text_config` of meta-llama/Llama-4-Scout-17B-16E and
# Llama-4-Maverick-17B-128E): hidden 5120, 48 layers, 40 query / 8 key-value heads of 128,
# vocabulary 202048, experts 8192 wide, dense layers 16384 wide, rope_theta 500000, every fourth
# layer NoPE, chunks of 8192, temperature tuning (floor_scale 8192, attn_scale 0.1), top-1 routing
# with a shared expert. The rotary table covers 131072 positions (the published
# max_position_embeddings, 10M for Scout and 1M for Maverick, would take gigabytes). Scout: 16
# experts in every layer, QK norm, llama3 rope scaling factor 16 (low and high frequency factors 1,
# original context 8192). Maverick: 128 experts in every other layer (1, 3, ..., 47), dense layers
# between, no QK norm, no rope scaling. tests/models/test_llama4.py checks the parameter counts
# against transformers' Llama4ForCausalLM of these configs: Scout 107,769,861,120 (17,172,894,720
# active per token), Maverick 400,711,848,960 (17,184,691,200 active).
_SCOUT = ModelArgs(rope_scaling=RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                            original_max_seq_len=8192))

# fmt: off
LLAMA4_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized MoE for runs and tests: 4 experts (top-2) with a shared expert in every other
    # layer, every second layer NoPE (with temperature tuning), chunks of 64 positions, QK norm.
    # The vocabulary matches the shipped Shakespeare tokenizer.
    "debugmodel_moe": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, explicit_head_dim=None,
                                vocab_size=2048, dense_hidden_dim=512, expert_hidden_dim=256, n_experts=4,
                                top_k=2, moe_every=2, nope_every=2, attention_chunk_size=64,
                                floor_scale=32, max_seq_len=2048),
    "llama4_scout": _SCOUT,
    "llama4_maverick": replace(_SCOUT, n_experts=128, moe_every=2, qk_norm=False, rope_scaling=None),
}
# fmt: on
