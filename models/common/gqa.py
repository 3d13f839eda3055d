"""Grouped-query attention (Ainslie et al., 2023) as the decoders write it: wq, wk, wv project the
input to query heads and fewer key/value heads, rotary turns queries and keys by position, the
causal core attends, wo projects the heads back.

The steps are methods (`project`, `rotate`, `attend`) so that a family whose attention adds a
step writes only its own `forward` from them (Llama 4: rotary on some layers only, an L2 norm of
q and k after the rotation, position-dependent query scaling).
"""

from __future__ import annotations

import torch
from torch import nn

from weft.layers.attention import CausalAttention
from weft.models.common.norms import RMSNorm
from weft.models.common.rotary import apply_rotary_emb


class GroupedQueryAttention(nn.Module):
    """softmax(q kᵀ / √d) v over n_heads query heads, each key/value head serving n_heads / kv_heads
    consecutive ones. `args` is any family's hyper-parameters with dim, n_heads, kv_heads and head_dim.

    qk_norm_eps: when given, queries and keys pass a per-head RMSNorm with weights over head_dim
    (`q_norm`, `k_norm`) *before* rotary, as Qwen3 does; None: no such norm (Llama).
    bias: wq, wk, wv and wo have biases (gpt-oss).
    """

    def __init__(self, args, *, qk_norm_eps: float | None = None, bias: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        self.core = CausalAttention()
        self.q_norm = None if qk_norm_eps is None else RMSNorm(args.head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(args.head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, document_ids: torch.Tensor | None = None,
                mask=None) -> torch.Tensor:
        """x: [batch, seq, dim]; rotations: [seq, head_dim/2] or [batch, seq, head_dim/2]; `mask` (or
        `document_ids` alone) as `CausalAttention` takes them."""
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, rotations)
        return self.attend(q, k, v, document_ids=document_ids, mask=mask)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [batch, seq, heads, head_dim], q and k through their norms where there are any.
        Head counts are inferred (-1) so the same code runs on a tensor-parallel shard of heads."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary position embeddings on queries and keys."""
        return apply_rotary_emb(q, rotations), apply_rotary_emb(k, rotations)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
               mask=None) -> torch.Tensor:
        """The core over [batch, seq, heads, head_dim] q, k, v, then wo: [batch, seq, dim]."""
        batch, seq = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        masking = {name: value for name, value in (("document_ids", document_ids), ("mask", mask)) if value is not None}
        out = self.core(q, k, v, **masking)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
