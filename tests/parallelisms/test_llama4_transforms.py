"""Activation checkpointing and compile on the debug Llama 4 MoE, through `parallelize`: each
trains as the plain model does (fp32, 5 AdamW steps, the routing bias moving after each step, so
every variant must route every token alike to stay equal)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from weft.components.moe_balance import balance_experts, moe_layers
from weft.models.llama4 import LLAMA4_FLAVORS, Transformer
from weft.parallelisms import ParallelizeOptions, parallelize
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.materialize import materialize

ARGS = replace(LLAMA4_FLAVORS["debugmodel_moe"], attention_chunk_size=8)  # chunks inside the 16 tokens
STEPS = 5

VARIANTS = {
    "full AC": dict(ac=ACOptions("full")),
    "selective op AC": dict(ac=ACOptions("selective", "op")),
    "selective AC every 2nd block": dict(ac=ACOptions("selective", "2")),
    "compile": pytest.param(dict(compile=CompileOptions("aot_eager")), marks=pytest.mark.slow),
    "compile + full AC": pytest.param(dict(compile=CompileOptions("aot_eager"), ac=ACOptions("full")),
                                      marks=pytest.mark.slow),
}


def train(**transforms) -> tuple[list[float], list[list[float]]]:
    """Losses of STEPS steps, and the MoE layers' routing biases after them."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize(model, None, ParallelizeOptions(fsdp=FSDPOptions(param_dtype=torch.float32), **transforms))
    materialize(model, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 16, (4, 17), generator=generator)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        balance_experts(model, rate=1e-2)
        losses.append(loss.item())
    return losses, [layer.expert_bias.tolist() for _, layer in moe_layers(model)]


@pytest.fixture(scope="module")
def plain() -> tuple[list[float], list[list[float]]]:
    return train()


@pytest.mark.parametrize("transforms", VARIANTS.values(), ids=VARIANTS.keys())
def test_transform_trains_the_debug_moe_as_the_plain_model_does(transforms, plain):
    losses, biases = train(**transforms)
    assert biases == plain[1]  # the same tokens went to the same experts at every step
    assert max(abs(a - b) for a, b in zip(losses, plain[0])) < 1e-5, (losses, plain[0])
