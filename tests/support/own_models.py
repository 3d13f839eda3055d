"""Two models weft did not write, shared by the tests of weft's transforms on other models:
a tiny transformers LlamaForCausalLM and a nanoGPT-style GPT-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.models.common.moe import MoE

SEQ_LEN, VOCAB = 16, 96


def hf_llama() -> nn.Module:
    """A tiny transformers Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int, n_experts: int = 0):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, n_head)
        self.ln_2 = nn.LayerNorm(dim)
        if n_experts:  # weft's MoE layer as the MLP: top 2, softmax scores weighing the experts' outputs
            self.mlp = MoE(dim, 2 * dim, n_experts, 2, score_func="softmax", score_before_experts=False)
            with torch.no_grad():
                for weight in (self.mlp.experts.w1, self.mlp.experts.w2, self.mlp.experts.w3):
                    nn.init.normal_(weight, std=0.1)
        else:
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """GPT-2 as nanoGPT writes it: blocks in `transformer.h`, learned positions, LayerNorm; with
    `n_experts`, weft's MoE layer as every block's MLP."""

    def __init__(self, dim: int = 32, n_head: int = 4, n_layer: int = 2, n_experts: int = 0):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, dim),
            wpe=nn.Embedding(SEQ_LEN, dim),
            h=nn.ModuleList(Block(dim, n_head, n_experts) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(dim),
        ))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
