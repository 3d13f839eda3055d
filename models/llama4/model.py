"""The Llama 4 text transformer (Scout, Maverick), written to read like Meta's description.

A pre-norm decoder like Llama 3 with four changes to attention and one to the feed-forward:

- interleaved positions (iRoPE): most layers rotate queries and keys (rotary layers) and attend
  only within chunks of `attention_chunk_size` positions; every `nope_every`-th layer has no
  position encoding (NoPE) and attends over the whole causal context;
- on rotary layers, queries and keys are L2-normalised per head after the rotation (QK norm);
- on NoPE layers, queries are scaled by 1 + attn_scale·log(1 + ⌊(position + 1) / floor_scale⌋)
  (attention temperature tuning), sharpening attention at long range;
- every `moe_every`-th layer's feed-forward is a Mixture of Experts (top-k routed SwiGLU
  experts with a shared expert beside them); the others are dense SwiGLU.

Norms, rotary, the attention core, masks and the dense SwiGLU are the shared ones of
`models/common/`; the projections are Llama's `Attention`.
Nothing here knows about parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from weft.models.common.feed_forward import FeedForward
from weft.models.common.init import param_seed, trunc_normal
from weft.models.common.norms import RMSNorm
from weft.models.common.rotary import apply_rotary_emb, rope_rotations
from weft.models.llama.model import Attention as LlamaAttention
from weft.models.llama4.args import ModelArgs
from weft.models.moe import MoE


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """The factor NoPE layers multiply each query by: 1 + attn_scale·log(1 + ⌊(position + 1) / floor_scale⌋)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def chunk_ids(positions: torch.Tensor, chunk_size: int, document_ids: torch.Tensor | None, batch: int,
              max_seq_len: int) -> torch.Tensor:
    """An id per token ([batch, seq]) shared exactly by the tokens of one chunk of one document
    (positions < max_seq_len): chunked attention is the document mask of these ids."""
    chunks = (positions // chunk_size).expand(batch, -1)
    if document_ids is None:
        return chunks
    return document_ids * (max_seq_len // chunk_size + 1) + chunks


class Attention(LlamaAttention):
    """Llama's grouped-query attention, with rotary (then QK norm) on rotary layers, and the
    temperature-scaled queries on NoPE layers."""

    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__(args)
        self.use_rope = use_rope
        self.qk_norm_eps = args.norm_eps if (args.qk_norm and use_rope) else None
        self.temperature_tuning = args.temperature_tuning and not use_rope

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, temperature: torch.Tensor,
                mask=None) -> torch.Tensor:
        """rotations: [seq, head_dim/2] or [batch, seq, head_dim/2]; temperature: [seq] or [batch, seq]."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.use_rope:
            q, k = apply_rotary_emb(q, rotations), apply_rotary_emb(k, rotations)
        if self.qk_norm_eps is not None:
            q = F.rms_norm(q.float(), (self.head_dim,), eps=self.qk_norm_eps).type_as(q)
            k = F.rms_norm(k.float(), (self.head_dim,), eps=self.qk_norm_eps).type_as(k)
        if self.temperature_tuning:
            q = (q * temperature[..., None, None]).type_as(q)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attention(norm(x)); out = h + feed_forward(norm(h)), the
    feed-forward an MoE or a dense SwiGLU."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, use_rope=args.uses_rope(layer))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = args.is_moe_layer(layer)
        if self.moe:
            self.feed_forward = MoE(args.dim, args.expert_hidden_dim, args.n_experts, args.top_k,
                                    shared_hidden_dim=args.expert_hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden_dim)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, temperature: torch.Tensor,
                masks: dict) -> torch.Tensor:
        """masks: the attention mask of rotary layers ("rope") and of NoPE layers ("nope"), None = causal."""
        mask = masks["rope" if self.attention.use_rope else "nope"]
        h = x + self.attention(self.attention_norm(x), rotations, temperature, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        rotations = rope_rotations(args, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_rotations", rotations, persistent=False)

    def attention_masks(self, positions: torch.Tensor, document_ids: torch.Tensor | None, batch: int) -> dict:
        """The masks of rotary layers (chunked, within documents) and NoPE layers (within documents),
        built once per micro-batch; None where plain causal attention is the mask."""
        core = next(iter(self.layers.values())).attention.core
        nope = None if document_ids is None else core.document_mask(document_ids)
        if self.args.attention_chunk_size is None:
            return {"rope": nope, "nope": nope}
        chunks = chunk_ids(positions, self.args.attention_chunk_size, document_ids, batch, self.args.max_seq_len)
        return {"rope": core.document_mask(chunks), "nope": nope}

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: [batch, seq] → logits [batch, seq, vocab].

        positions ([seq] or [batch, seq], default 0..seq-1) choose the rotary angles, the
        chunks of chunked attention and the NoPE temperature; document_ids ([batch, seq]) keep
        attention inside each packed document.
        """
        batch, seq = tokens.shape[:2]
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)
        rotations = self.rope_rotations[positions]
        temperature = attention_temperature(positions, self.args.floor_scale, self.args.attn_scale)
        masks = self.attention_masks(positions, document_ids, batch) if len(self.layers) else {}
        # A pipeline stage (parallelisms/pipeline.py) lacks the modules other stages own (None):
        # without the embedding its input is the previous stage's hidden state.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rotations, temperature, masks)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        total = sum(p.numel() for p in self.parameters())
        idle = 1 - self.args.top_k / self.args.n_experts
        routed = sum(p.numel() for layer in self.layers.values() if layer.moe
                     for p in layer.feed_forward.experts.parameters())
        return total - round(routed * idle)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, names: Collection[str] | None = None) -> None:
        """Fill every parameter (or those of `names`) and buffer on the device it lives on, each
        from its own generator seeded by (seed, name), as Llama does: truncated normal std 0.02,
        residual projections (wo, w2, the experts' down projection) scaled by 1/√(2·n_layers),
        embeddings std 1, output std 1/√dim, norms 1; the MoE layers' balancing bias 0."""
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
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                std = residual_std
            else:
                std = 0.02
            param.copy_(trunc_normal(param.shape, std, param.dtype, param.device, param_seed(seed, name)))
        self.rope_rotations.copy_(rope_rotations(self.args, device=self.rope_rotations.device))
        for layer in self.layers.values():
            if layer.moe:  # balancing state: no bias, nothing counted
                layer.feed_forward.expert_bias.zero_()
                layer.feed_forward.tokens_per_expert.zero_()
