"""The Llama 4 text transformer (Scout, Maverick), written to read like Meta's description.

A pre-norm decoder like Llama 3 with interleaved positions (iRoPE: rotary layers attend within
chunks of `attention_chunk_size`, every `nope_every`-th layer has no position encoding and attends
over the whole causal context), QK norm on rotary layers, attention temperature tuning on NoPE
layers, and a Mixture of Experts every `moe_every`-th layer. The shared layers are those of
`models/common/`; nothing here knows about parallelism (docs/moe.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.layers.nf4_experts import weight_numel
from weft.models.common.decoder import Decoder
from weft.models.common.feed_forward import FeedForward
from weft.models.common.gqa import GroupedQueryAttention
from weft.models.common.moe import MoE
from weft.models.common.norms import RMSNorm
from weft.models.llama4.args import ModelArgs


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


class Attention(GroupedQueryAttention):
    """Grouped-query attention, with rotary (then QK norm) on rotary layers, and the
    temperature-scaled queries on NoPE layers."""

    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__(args)
        self.use_rope = use_rope
        self.qk_l2_eps = args.norm_eps if (args.qk_norm and use_rope) else None
        self.temperature_tuning = args.temperature_tuning and not use_rope

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, temperature: torch.Tensor,
                mask=None) -> torch.Tensor:
        """rotations: [seq, head_dim/2] or [batch, seq, head_dim/2]; temperature: [seq] or [batch, seq]."""
        q, k, v = self.project(x)
        if self.use_rope:
            q, k = self.rotate(q, k, rotations)
        if self.qk_l2_eps is not None:
            q = F.rms_norm(q.float(), (self.head_dim,), eps=self.qk_l2_eps).type_as(q)
            k = F.rms_norm(k.float(), (self.head_dim,), eps=self.qk_l2_eps).type_as(k)
        if self.temperature_tuning:
            q = (q * temperature[..., None, None]).type_as(q)
        return self.attend(q, k, v, mask=mask)


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


class Transformer(Decoder):
    """Token embedding → n_layers TransformerBlocks → RMSNorm → output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda layer: TransformerBlock(args, layer))

    def attention_masks(self, positions: torch.Tensor, document_ids: torch.Tensor | None, batch: int) -> dict:
        """The masks of rotary layers (chunked, within documents) and NoPE layers (within documents),
        built once per micro-batch; None where plain causal attention is the mask."""
        core = self.attention_core()
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
        return self.run_blocks(tokens, rotations, temperature, masks)

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        total = weight_numel(self)
        idle = 1 - self.args.top_k / self.args.n_experts
        routed = sum(weight_numel(layer.feed_forward.experts) for layer in self.layers.values() if layer.moe)
        return total - round(routed * idle)
