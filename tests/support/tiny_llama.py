"""A 2-layer Llama of dim 64 and a few fixed batches, trained by plain PyTorch: the optimizer tests' model."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from weft.models.llama.args import LLAMA_FLAVORS
from weft.models.llama.model import Transformer

STEPS = 3


def tiny_llama() -> Transformer:
    args = replace(LLAMA_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 17), generator=generator) for _ in range(STEPS)]


def train(model, optimizers, tokens_list) -> None:
    for tokens in tokens_list:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
