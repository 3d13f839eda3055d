"""The Llama transformer (Llama 2, Llama 3 / 3.1 / 3.2), written to read like the papers.

Pre-norm decoder: RMSNorm, rotary position embeddings (with Llama 3.1 frequency scaling),
grouped-query attention, SwiGLU feed-forward. The parts another model shares (norms, rotary,
grouped-query attention, SwiGLU, the decoder frame with its initialisation) live in
`models/common/`; what is Llama's own is its block. Nothing here knows about
parallelism: the transforms in `parallelisms/` reshape this model from the outside.
"""

from __future__ import annotations

from weft.models.common.decoder import Decoder, PreNormBlock
from weft.models.common.feed_forward import FeedForward
from weft.models.common.gqa import GroupedQueryAttention as Attention
from weft.models.common.norms import RMSNorm
from weft.models.llama.args import ModelArgs


class TransformerBlock(PreNormBlock):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)


class Transformer(Decoder):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits; the
    decoder's forward (rotations and the document mask to every block)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda layer: TransformerBlock(args))
