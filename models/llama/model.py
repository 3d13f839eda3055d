"""The Llama transformer (Llama 2, Llama 3 / 3.1 / 3.2), written to read like the papers.

Pre-norm decoder: RMSNorm, rotary position embeddings (with Llama 3.1 frequency scaling),
grouped-query attention, SwiGLU feed-forward. Nothing here knows about parallelism: the
transforms in `parallelisms/` reshape this model from the outside.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from weft.models.llama.args import ModelArgs, RopeScaling

# ---------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Angular frequency of each pair of channels: theta^(-2i/head_dim), i < head_dim/2.

    With Llama 3.1 scaling, wavelengths longer than the original context are slowed down by
    `factor`, short ones are kept, and the band in between is interpolated smoothly.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated),
    )


def rope_rotations(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """e^(i · position · frequency), the rotation of every channel pair at every position < max_seq_len:
    complex64 [max_seq_len, head_dim/2] (angles computed in float64)."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def apply_rotary_emb(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair (x[2i], x[2i+1]) of every head by its position's angle.

    Read as the complex number x[2i] + i·x[2i+1], a pair rotates by angle θ when multiplied by
    e^(iθ): one element-wise kernel, where the same rotation written with cos and sin takes four
    multiplies, two adds and a stack (and their backwards).
    x: [batch, seq, heads, head_dim]; rotations: [seq, head_dim/2] or [batch, seq, head_dim/2].
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotated = pairs * rotations.unsqueeze(-2)  # broadcast over heads
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # one upcast, shared by the statistic and the scaling
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


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
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if q.is_cuda and not torch.compiler.is_compiling():  # eager FlexAttention materialises the scores: compile it once
        flex_attention = _compiled("flex_attention", flex_attention)
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


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
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_docs.shape[-1] - q_docs.shape[-1]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_docs[b, q_idx] == kv_docs[b, kv_idx])

    if q_docs.is_cuda and not torch.compiler.is_compiling():
        create_block_mask = _compiled("create_block_mask", create_block_mask)
    return create_block_mask(same_document_causal, q_docs.shape[0], None, q_docs.shape[-1], kv_docs.shape[-1],
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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, document_ids: torch.Tensor | None = None,
                mask=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Head counts are inferred (-1) so the same code runs on a tensor-parallel shard of heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary_emb(q, rotations), apply_rotary_emb(k, rotations)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        masking = {name: value for name, value in (("document_ids", document_ids), ("mask", mask)) if value is not None}
        out = self.core(q, k, v, **masking)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) ⊙ w3 x) (Shazeer, 2020)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class Transformer(nn.Module):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keeps parameter names ("layers.3.attention.wq.weight") stable if blocks are removed.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Complex: `model.to(dtype)` would keep only its real part; cast parameters, not the model.
        rotations = rope_rotations(args, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_rotations", rotations, persistent=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: [batch, seq] → logits [batch, seq, vocab].

        positions ([seq] or [batch, seq]) give each token's place in its sequence; they default
        to 0..seq-1 and differ when the sequence is split across devices, or when several
        documents are packed into one sample (each restarts at 0). document_ids ([batch, seq])
        make attention block-causal: no token attends to another document.
        """
        if positions is None:
            rotations = self.rope_rotations[: tokens.shape[1]]
        else:
            rotations = self.rope_rotations[positions]
        # Packed documents: the attention core's mask is built once here, outside the (compiled,
        # checkpointed) blocks, and every block uses it.
        mask = None
        if document_ids is not None and len(self.layers):
            core = next(iter(self.layers.values())).attention.core
            mask = core.document_mask(document_ids) if hasattr(core, "document_mask") else None
        # A pipeline stage (parallelisms/pipeline.py) lacks the modules other stages own (None):
        # without the embedding its input is the previous stage's hidden state, and it must be
        # given positions when that is split along the sequence.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rotations, document_ids=document_ids, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, names: Collection[str] | None = None) -> None:
        """Fill every parameter (or those of `names`) and buffer on the device it lives on.

        Each weight is drawn whole from its own generator, seeded by (seed, parameter name), so
        its values depend on nothing else: not on the order of initialisation, and not on how the
        parameter is later split across devices (a split parameter is filled with its slice of the
        full draw). Linear weights: truncated normal, std 0.02, with the residual projections
        (wo, w2) scaled by 1/√(2·n_layers) (GPT-2); embeddings: std 1; output: std 1/√dim.
        """
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if names is not None and name not in names:
                continue
            if name.endswith("norm.weight"):
                param.copy_(torch.ones(param.shape, dtype=param.dtype, device=param.device))
                continue
            if name == "tok_embeddings.weight":
                std = self.args.dim**-0.5 if self.args.tie_embeddings else 1.0
            elif name == "output.weight":
                std = self.args.dim**-0.5
            elif name.endswith(("wo.weight", "w2.weight")):
                std = residual_std
            else:
                std = 0.02
            param.copy_(_trunc_normal(param.shape, std, param.dtype, param.device, _param_seed(seed, name)))
        self.rope_rotations.copy_(rope_rotations(self.args, device=self.rope_rotations.device))


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _trunc_normal(shape, std: float, dtype, device, seed: int) -> torch.Tensor:
    """N(0, std²) truncated at ±3 std, drawn from a generator of its own."""
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.empty(shape, dtype=torch.float32, device=device)
    nn.init.trunc_normal_(values, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return values.to(dtype)
