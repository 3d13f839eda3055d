"""The Llama transformer (Llama 2, Llama 3 / 3.1 / 3.2), written to read like the papers.

Pre-norm decoder: RMSNorm, rotary position embeddings (with Llama 3.1 frequency scaling),
grouped-query attention, SwiGLU feed-forward. The layers another model shares (norms, rotary,
the attention core, SwiGLU, initialisation) live in `models/common/`. Nothing here knows about
parallelism: the transforms in `parallelisms/` reshape this model from the outside.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import nn

from weft.models.common.attention import CausalAttention
from weft.models.common.feed_forward import FeedForward
from weft.models.common.init import param_seed, trunc_normal
from weft.models.common.norms import RMSNorm
from weft.models.common.rotary import apply_rotary_emb, rope_rotations
from weft.models.llama.args import ModelArgs

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
            param.copy_(trunc_normal(param.shape, std, param.dtype, param.device, param_seed(seed, name)))
        self.rope_rotations.copy_(rope_rotations(self.args, device=self.rope_rotations.device))
