"""Qwen3 and Qwen3-MoE (Qwen Team, 2025), written to read like the report.

A pre-norm decoder like Llama 3 with a per-head RMSNorm on queries and keys before rotary
(`q_norm`, `k_norm`), head_dim its own hyper-parameter and, in Qwen3-MoE, Mixture-of-Experts layers
(every `decoder_sparse_step`-th not in `mlp_only_layers`: softmax router, scores renormalised where
`norm_topk_prob`, no shared expert). The shared layers are those of `models/common/`; nothing here
knows about parallelism (docs/qwen3.md).
"""

from __future__ import annotations

from weft.layers.nf4_experts import weight_numel
from weft.models.common.decoder import Decoder, PreNormBlock
from weft.models.common.feed_forward import FeedForward
from weft.models.common.gqa import GroupedQueryAttention
from weft.models.common.moe import MoE
from weft.models.common.norms import RMSNorm
from weft.models.qwen3.args import ModelArgs


class TransformerBlock(PreNormBlock):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + feed_forward(norm(h)), the
    attention with its q/k norms, the feed-forward an MoE or a dense SwiGLU."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = GroupedQueryAttention(args, qk_norm_eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = args.is_moe_layer(layer)
        if self.moe:
            self.feed_forward = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, score_func="softmax",
                                    score_before_experts=False, norm_topk_prob=args.norm_topk_prob)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden_dim)


class Transformer(Decoder):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits; the
    decoder's forward (rotations and the document mask to every block)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda layer: TransformerBlock(args, layer))

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        total = weight_numel(self)
        if not self.args.n_experts:
            return total
        idle = 1 - self.args.top_k / self.args.n_experts
        routed = sum(weight_numel(layer.feed_forward.experts) for layer in self.layers.values() if layer.moe)
        return total - round(routed * idle)
