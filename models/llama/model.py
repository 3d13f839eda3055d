"""The Llama transformer (Llama 2, Llama 3 / 3.1 / 3.2), written to read like the papers.

Pre-norm decoder: RMSNorm, rotary position embeddings (with Llama 3.1 frequency scaling),
grouped-query attention, SwiGLU feed-forward. The parts another model shares (norms, rotary,
grouped-query attention, SwiGLU, the decoder frame with its initialisation) live in
`models/common/`; what is Llama's own is the block and what the forward hands it. Nothing here knows about
parallelism: the transforms in `parallelisms/` reshape this model from the outside.
"""

from __future__ import annotations

import torch
from torch import nn

from weft.models.common.decoder import Decoder
from weft.models.common.feed_forward import FeedForward
from weft.models.common.gqa import GroupedQueryAttention as Attention
from weft.models.common.norms import RMSNorm
from weft.models.llama.args import ModelArgs


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, document_ids: torch.Tensor | None = None,
                mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotations, document_ids=document_ids, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda layer: TransformerBlock(args))

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: [batch, seq] → logits [batch, seq, vocab].

        positions ([seq] or [batch, seq]) give each token's place in its sequence; they default
        to 0..seq-1 and differ when the sequence is split across devices, or when several
        documents are packed into one sample (each restarts at 0). document_ids ([batch, seq])
        make attention block-causal: no token attends to another document. A pipeline stage
        without the embedding is given the previous stage's hidden state as `tokens`, and must
        be given positions when that is split along the sequence.
        """
        if positions is None:
            rotations = self.rope_rotations[: tokens.shape[1]]
        else:
            rotations = self.rope_rotations[positions]
        # Packed documents: the attention core's mask is built once here, outside the (compiled,
        # checkpointed) blocks, and every block uses it.
        mask = None
        if document_ids is not None and len(self.layers):
            core = self.attention_core()
            mask = core.document_mask(document_ids) if hasattr(core, "document_mask") else None
        return self.run_blocks(tokens, rotations, document_ids=document_ids, mask=mask)
