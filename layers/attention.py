"""The attention core shared by the models: causal (and block-causal, for packed documents)
softmax(q kᵀ / √d) v with grouped-query heads, on SDPA or FlexAttention; and gpt-oss's core with
per-head sinks over the whole past or a sliding window (`SinkAttention`).

Models project q, k, v their own way and call a `CausalAttention` module, so that context
parallelism can swap that one module for a version that sees the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention


def document_causal_mask(q_docs: torch.Tensor, kv_docs: torch.Tensor) -> torch.Tensor:
    """Block-causal mask: query i sees key j iff j <= i and both lie in the same document.

    q_docs [batch, q_len], kv_docs [batch, kv_len] hold each token's document id, with the queries
    aligned to the end of the keys (query i sits at key position i + kv_len - q_len). Returns a
    boolean [batch, 1, q_len, kv_len] (True = attend). Every query sees at least itself.
    """
    q_len, kv_len = q_docs.shape[-1], kv_docs.shape[-1]
    q_at = torch.arange(q_len, device=q_docs.device) + (kv_len - q_len)
    causal = torch.arange(kv_len, device=q_docs.device)[None, :] <= q_at[:, None]
    return (causal & (q_docs[:, :, None] == kv_docs[:, None, :])).unsqueeze(1)


def use_flex_attention(device: torch.device) -> bool:
    """Which kernel masks packed documents on `device`: FlexAttention on CUDA (its block mask skips
    the blocks that cross documents and is a few bits per 128 x 128 block), SDPA with a dense
    boolean mask elsewhere (FlexAttention has no backward on the CPU in PyTorch 2.13)."""
    return device.type == "cuda"


def document_mask(q_docs: torch.Tensor, kv_docs: torch.Tensor | None = None, *, flex: bool):
    """The block-causal mask of packed documents (`document_causal_mask`; kv_docs default to
    q_docs): a FlexAttention `BlockMask` (flex), else the dense boolean [batch, 1, q, kv] SDPA takes.

    Attention cores build it once per micro-batch (`CausalAttention.document_mask`, called by
    `Transformer.forward` before the blocks), and every block and its activation-checkpoint
    recompute reuse it. On CUDA the block mask comes from a compiled `create_block_mask`, which
    never materialises the dense mask."""
    kv_docs = q_docs if kv_docs is None else kv_docs
    if flex:
        return document_block_mask(q_docs, kv_docs)
    return document_causal_mask(q_docs, kv_docs)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ / √d + mask) v with grouped-query heads, for a mask from `document_mask`."""

    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    attend = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():  # eager FlexAttention materialises the scores: compile it once
        attend = _compiled("flex_attention", flex_attention)
    return attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_docs: torch.Tensor, kv_docs: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ / √d + block-causal mask) v: causal attention that never crosses documents, with
    a mask built here (for a core called without the one `Transformer.forward` builds).

    On CUDA, FlexAttention with a block mask skips the blocks that cross documents; on the CPU
    (where FlexAttention has no backward as of PyTorch 2.13) SDPA takes the boolean mask.
    """
    if use_flex_attention(q.device):
        return masked_attention(q, k, v, document_block_mask(q_docs, kv_docs), scale)
    return masked_attention(q, k, v, document_causal_mask(q_docs, kv_docs), scale)


def document_block_mask(q_docs: torch.Tensor, kv_docs: torch.Tensor):
    """FlexAttention's block mask of `document_causal_mask` (queries aligned to the end of the keys)."""

    offset = kv_docs.shape[-1] - q_docs.shape[-1]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_docs[b, q_idx] == kv_docs[b, kv_idx])

    create = create_block_mask
    if q_docs.is_cuda and not torch.compiler.is_compiling():
        create = _compiled("create_block_mask", create_block_mask)
    return create(same_document_causal, q_docs.shape[0], None, q_docs.shape[-1], kv_docs.shape[-1],
                  device=q_docs.device)


_COMPILED: dict[str, object] = {}


def _compiled(name: str, function):
    """torch.compile(function), made once per process."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(function, dynamic=False)
    return _COMPILED[name]


class CausalAttention(nn.Module):
    """softmax(q kᵀ / √d + causal mask) v with grouped-query heads.

    q: [batch, n_heads, seq, head_dim]; k, v: [batch, n_kv_heads, seq, head_dim]; each key/value
    head serves n_heads / n_kv_heads consecutive query heads. With `mask` (from `document_mask`,
    for packed samples) the mask is block-causal: tokens attend only within their document;
    `document_ids` ([batch, seq]) alone build it here. A module of its own so that context
    parallelism can swap in a version that sees the whole sequence.
    """

    def document_mask(self, document_ids: torch.Tensor):
        """The mask `forward` takes for these document ids, built once per micro-batch."""
        return document_mask(document_ids, flex=use_flex_attention(document_ids.device))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
        mask=None,
    ) -> torch.Tensor:
        if mask is not None:
            return masked_attention(q, k, v, mask)
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return document_attention(q, k, v, document_ids, document_ids)


def window_causal_mask(seq_len: int, window: int | None, document_ids: torch.Tensor | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """Boolean [batch or 1, 1, seq, seq] (True = attend): causal, within the document where
    `document_ids` are given, and, with a `window`, to the current token and the window - 1 before it."""
    if document_ids is not None:
        allowed = document_causal_mask(document_ids, document_ids)
    else:
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    if window is not None:
        at = torch.arange(seq_len, device=allowed.device)
        allowed = allowed & (at[:, None] - at[None, :] < window)
    return allowed


def window_block_mask(seq_len: int, window: int | None, document_ids: torch.Tensor | None, batch: int,
                      device: torch.device):
    """FlexAttention's block mask of `window_causal_mask`: blocks wholly outside the window or another
    document are skipped."""

    def allowed(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if document_ids is not None:
            keep = keep & (document_ids[b, q_idx] == document_ids[b, kv_idx])
        return keep

    make = create_block_mask
    if device.type == "cuda" and not torch.compiler.is_compiling():
        make = _compiled("create_block_mask", create_block_mask)
    return make(allowed, batch if document_ids is not None else None, None, seq_len, seq_len, device=device)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask) -> torch.Tensor:
    """softmax([q kᵀ / √d + mask, sink_h]) v without the sink's column: each head h has a learned
    logit `sinks[h]` that takes its share of the softmax and gives nothing back (gpt-oss).

    `mask`: a FlexAttention BlockMask (CUDA), where the kernel's log-sum-exp gives the same as
    out · σ(lse - sink); else a boolean [batch or 1, 1, q, kv] for SDPA, with one zero key and
    value more whose mask bias is the sink. Both differentiate through the sinks."""

    if isinstance(mask, BlockMask):
        attend = flex_attention
        if q.is_cuda and not torch.compiler.is_compiling():
            attend = _compiled("flex_attention_lse", flex_attention)
        out, aux = attend(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        kept = torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1))
        return out * kept.unsqueeze(-1).to(out.dtype)
    batch, heads, seq, _ = q.shape
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(bias.shape[0], heads, seq, 1)
    bias = torch.cat([bias.expand(-1, heads, -1, -1), sink], dim=-1)
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[-1])
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), attn_mask=bias,
                                          enable_gqa=True)


class SinkAttention(CausalAttention):
    """Causal attention with a learned sink logit per query head (`sinks`, `sink_attention`), over
    the whole past or a sliding `window` (the current token and the window - 1 before it). Context
    parallelism does not replace it (its core is plain causal)."""

    def __init__(self, n_heads: int, window: int | None = None):
        super().__init__()
        self.window = window
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def masks(self, seq_len: int, document_ids: torch.Tensor | None, batch: int, device: torch.device):
        """The mask `forward` takes, built once per micro-batch: a block mask on CUDA, else boolean."""
        if use_flex_attention(device):
            return window_block_mask(seq_len, self.window, document_ids, batch, device)
        return window_causal_mask(seq_len, self.window, document_ids, device)

    def local_sinks(self) -> torch.Tensor:
        """The sinks of the heads this module computes (all of them; tensor parallelism's its rank's)."""
        return self.sinks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if mask is None:
            mask = self.masks(q.shape[2], None, q.shape[0], q.device)
        return sink_attention(q, k, v, self.local_sinks(), mask)
