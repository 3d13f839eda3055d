"""gpt-oss hyper-parameters and the published flavors, plus a CPU-sized one.

Names follow weft's other families where the idea is shared; the Hugging Face `GptOssConfig` field
each one mirrors is given beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from weft.models.common.rotary import YarnScaling
from weft.models.common.shape_checks import check_heads, check_top_k

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 2880  # hidden_size
    n_layers: int = 24  # num_hidden_layers
    n_heads: int = 64  # num_attention_heads
    n_kv_heads: int = 8  # num_key_value_heads
    head_dim: int = 64  # head_dim
    vocab_size: int = 201088
    norm_eps: float = 1e-5  # rms_norm_eps
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = YarnScaling()  # rope_parameters of rope_type yarn
    max_seq_len: int = 131072  # max_position_embeddings: positions the rotary table covers
    tie_embeddings: bool = False  # tie_word_embeddings
    n_experts: int = 32  # num_local_experts
    top_k: int = 4  # num_experts_per_tok
    moe_hidden_dim: int = 2880  # intermediate_size: width of each expert
    swiglu_alpha: float = 1.702  # swiglu_alpha: the gate's sigmoid slope
    swiglu_limit: float = 7.0  # swiglu_limit: gate clamped above, up clamped on both sides
    sliding_window: int = 128  # sliding_window: a sliding layer sees the current token and window - 1 before it
    layer_types: tuple[str, ...] = ()  # layer_types; () is transformers' default: sliding, full, sliding, ...

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else LAYER_TYPES[layer % 2]

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a full-attention one."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def attended_context(self, layer: int, seq_len: int) -> int:
        """How many keys the last query of a sequence of seq_len attends to in `layer`."""
        window = self.window(layer)
        return seq_len if window is None else min(seq_len, window)

    @property
    def ffn_hidden_dim(self) -> int:
        """The feed-forward width one token passes through: its top_k experts' (memory estimate)."""
        return self.top_k * self.moe_hidden_dim

    @property
    def routed_hidden_dim(self) -> int:
        return self.top_k * self.moe_hidden_dim

    @property
    def routed_slots(self) -> float:
        return float(self.top_k)

    def __post_init__(self) -> None:
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        check_top_k(self.top_k, self.n_experts)
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types holds {sorted(unknown)[0]}; expected {' or '.join(LAYER_TYPES)}")


# openai/gpt-oss-20b and -120b (config.json): 64 query heads of 64, 8 key/value heads, YaRN x32 over
# 4096 positions, windows of 128 on every other layer, 4 experts a token; 20b has 24 layers and 32
# experts, 120b 36 and 128. tests/models/test_gpt_oss.py checks both counts against transformers'.
_GPT_OSS = ModelArgs()
# fmt: off
GPT_OSS_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized, the shipped Shakespeare tokenizer's vocabulary: 8 experts (top 2), windows of 32.
    "debugmodel_gpt_oss": replace(_GPT_OSS, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                                  vocab_size=2048, n_experts=8, top_k=2, moe_hidden_dim=256, sliding_window=32,
                                  max_seq_len=2048),
    "gpt_oss_20b": replace(_GPT_OSS, n_layers=24, n_experts=32),
    "gpt_oss_120b": replace(_GPT_OSS, n_layers=36, n_experts=128),
}
# fmt: on
