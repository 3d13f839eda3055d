"""Qwen3 and Qwen3-MoE hyper-parameters and the published flavors, plus two CPU-sized ones.

One dataclass holds both: a dense Qwen3 is the MoE one with no experts (`n_experts` 0). Names follow
weft's other families where the idea is shared; the Hugging Face `Qwen3Config` / `Qwen3MoeConfig`
field each one mirrors is given beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from weft.models.common.rotary import RopeScaling
from weft.models.common.shape_checks import check_heads, check_top_k


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096  # hidden_size
    n_layers: int = 36  # num_hidden_layers
    n_heads: int = 32  # num_attention_heads
    n_kv_heads: int = 8  # num_key_value_heads
    head_dim: int = 128  # head_dim: explicit, not dim / n_heads (0.6B: 128 where 1024 / 16 is 64)
    vocab_size: int = 151936
    norm_eps: float = 1e-6  # rms_norm_eps, also the q/k norms'
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None  # rope_scaling of rope_type llama3 (Qwen3's own YaRN is refused)
    max_seq_len: int = 40960  # max_position_embeddings: positions the rotary table covers
    tie_embeddings: bool = False  # tie_word_embeddings
    dense_hidden_dim: int = 12288  # intermediate_size: SwiGLU width of the dense layers
    n_experts: int = 0  # num_experts; 0: a dense Qwen3, no MoE layer
    top_k: int = 8  # num_experts_per_tok
    moe_hidden_dim: int = 768  # moe_intermediate_size: width of each routed expert
    norm_topk_prob: bool = False  # renormalise the chosen experts' softmax scores to sum to 1
    decoder_sparse_step: int = 1  # layers decoder_sparse_step-1, 2·decoder_sparse_step-1, ... are MoE
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense whatever decoder_sparse_step says

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: experts exist, the layer is not in mlp_only_layers, and
        (layer + 1) is a multiple of decoder_sparse_step."""
        return self.n_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def ffn_hidden_dim(self) -> int:
        """The feed-forward width one token passes through, averaged over the layers: the dense
        SwiGLU's, or its top_k experts'. What the memory estimate scales a block's feed-forward
        activations by (components/memory.py)."""
        moe = self.n_moe_layers
        return (moe * self.top_k * self.moe_hidden_dim + (self.n_layers - moe) * self.dense_hidden_dim) // self.n_layers

    @property
    def routed_hidden_dim(self) -> int:
        """The routed experts' part of `ffn_hidden_dim` (it follows the routing, not the token)."""
        return self.n_moe_layers * self.top_k * self.moe_hidden_dim // self.n_layers

    @property
    def routed_slots(self) -> float:
        """Expert slots one token fills in a block, averaged over the layers."""
        return self.n_moe_layers * self.top_k / self.n_layers

    def __post_init__(self) -> None:
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        if self.n_experts:
            check_top_k(self.top_k, self.n_experts)
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1")


# Published configs (config.json of Qwen/Qwen3-*): vocabulary 151936, head_dim 128, rope_theta 1e6,
# rms_norm_eps 1e-6, 40960 positions; embeddings tied up to 4B. The MoE flavors have 128 experts
# (top 8, scores renormalised) in every layer; their intermediate_size (dense layers) is unused.
# tests/models/test_qwen3.py checks each flavor's parameter count (and the MoE flavors' active
# count) against the numbers transformers gives for these configs.
_QWEN3 = ModelArgs()
_QWEN3_MOE = replace(_QWEN3, n_experts=128, top_k=8, norm_topk_prob=True)
# CPU-sized Qwen3 for runs and tests; the vocabulary matches the shipped Shakespeare tokenizer.
# head_dim 64 is not dim / n_heads (32), as in Qwen3-0.6B.
_DEBUG_QWEN3 = replace(_QWEN3, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2048,
                       dense_hidden_dim=512, max_seq_len=2048)

# fmt: off
QWEN3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel_qwen3": replace(_DEBUG_QWEN3, tie_embeddings=True),
    # The same with its own output projection (as from 8B up): one that pipeline parallelism can split.
    "debugmodel_qwen3_untied": _DEBUG_QWEN3,
    # 8 experts (top 2, renormalised) in layers 0, 2 and 3; layer 1 dense (mlp_only_layers).
    "debugmodel_qwen3_moe": replace(_DEBUG_QWEN3, n_experts=8, top_k=2, moe_hidden_dim=128, norm_topk_prob=True,
                                    mlp_only_layers=(1,)),
    "qwen3_0_6b": replace(_QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, dense_hidden_dim=3072,
                          tie_embeddings=True),
    "qwen3_1_7b": replace(_QWEN3, dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, dense_hidden_dim=6144,
                          tie_embeddings=True),
    "qwen3_4b": replace(_QWEN3, dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, dense_hidden_dim=9728,
                        tie_embeddings=True),
    "qwen3_8b": replace(_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, dense_hidden_dim=12288),
    "qwen3_14b": replace(_QWEN3, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, dense_hidden_dim=17408),
    "qwen3_32b": replace(_QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, dense_hidden_dim=25600),
    "qwen3_30b_a3b": replace(_QWEN3_MOE, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, dense_hidden_dim=6144,
                             moe_hidden_dim=768),
    "qwen3_235b_a22b": replace(_QWEN3_MOE, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, dense_hidden_dim=12288,
                               moe_hidden_dim=1536),
}
# fmt: on
