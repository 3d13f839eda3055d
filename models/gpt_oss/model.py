"""gpt-oss (OpenAI, 2025), written to read like the model card.

A pre-norm MoE decoder: grouped-query attention with biases on every projection and a learned
sink logit per head, sliding-window layers (the current token and window - 1 before it) beside
full ones, YaRN rotary; every feed-forward an MoE whose router has a bias and whose experts have
biases and the clamped SwiGLU (models/common/moe.py: `ClampedSwiGLUExperts`). The shared layers
are those of `models/common/`; nothing here knows about parallelism (docs/gpt-oss.md).
"""

from __future__ import annotations

import torch
from torch import nn

from weft.layers.attention import SinkAttention
from weft.layers.nf4_experts import weight_numel
from weft.models.common.decoder import Decoder
from weft.models.common.gqa import GroupedQueryAttention
from weft.models.common.moe import ClampedSwiGLUExperts, MoE
from weft.models.common.norms import RMSNorm
from weft.models.gpt_oss.args import ModelArgs


class Attention(GroupedQueryAttention):
    """Biased q/k/v/o projections around a sink core over the whole past or the layer's window."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, bias=True)
        self.core = SinkAttention(args.n_heads, args.window(layer))  # with one sink logit per query head

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, masks: dict | None = None) -> torch.Tensor:
        """x: [batch, seq, dim]; `masks`: window (None: full) -> the mask its core takes."""
        batch, seq, _ = x.shape
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, rotations)
        mask = None if masks is None else masks[self.core.window]
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + moe(norm(h))."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = True
        experts = ClampedSwiGLUExperts(args.dim, args.moe_hidden_dim, args.n_experts, alpha=args.swiglu_alpha,
                                       limit=args.swiglu_limit)
        self.feed_forward = MoE(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k, score_func="softmax",
                                score_before_experts=False, norm_topk_prob=True, router_bias=True, experts=experts)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, masks: dict | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotations, masks)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda layer: TransformerBlock(args, layer))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As `Decoder.forward`; each window's mask (full and sliding) built once for every block."""
        rotations = self.rope_rotations[: tokens.shape[1]] if positions is None else self.rope_rotations[positions]
        cores = {layer.attention.core.window: layer.attention.core for layer in self.layers.values()}
        masks = {window: core.masks(tokens.shape[1], document_ids, tokens.shape[0], tokens.device)
                 for window, core in cores.items()}
        return self.run_blocks(tokens, rotations, masks=masks)

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the experts it is not sent to."""
        idle = 1 - self.args.top_k / self.args.n_experts
        routed = sum(weight_numel(layer.feed_forward.experts) for layer in self.layers.values())
        return weight_numel(self) - round(routed * idle)
