"""Activation checkpointing and compile on the debug Llama 4 MoE and the debug Qwen3-MoE (its layer 1
a dense Qwen3 block), through `parallelize`: each trains as the plain model does (fp32, 5 AdamW
steps, the routing bias moving after each step, so every variant must route every token alike to
stay equal)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from weft.components.training.moe_balance import balance_experts, moe_layers
from weft.models import llama4, qwen3
from weft.parallelisms import ParallelizeOptions, parallelize
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.materialize import materialize

MODELS = {  # name -> (model class, its arguments)
    "llama4": (llama4.Transformer, replace(llama4.LLAMA4_FLAVORS["debugmodel_moe"], attention_chunk_size=8)),  # chunks inside the 16 tokens
    "qwen3_moe": (qwen3.Transformer, qwen3.QWEN3_FLAVORS["debugmodel_qwen3_moe"]),
}
STEPS = 5

VARIANTS = {
    "full AC": dict(ac=ACOptions("full")),
    "selective op AC": dict(ac=ACOptions("selective", "op")),
    "selective AC every 2nd block": dict(ac=ACOptions("selective", "2")),
    "compile": dict(compile=CompileOptions("aot_eager")),
    "compile + full AC": dict(compile=CompileOptions("aot_eager"), ac=ACOptions("full")),
}
SLOW = {"compile", "compile + full AC"}


def train(model_name: str, **transforms) -> tuple[list[float], list[list[float]]]:
    """Losses of STEPS steps, and the MoE layers' routing biases after them."""
    transformer, args = MODELS[model_name]
    with torch.device("meta"):
        model = transformer(args)
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


# Qwen3-MoE: both AC modes and one (slow) compile.
def case(model_name: str, variant: str):
    return pytest.param(model_name, VARIANTS[variant], marks=[pytest.mark.slow] if variant in SLOW else [],
                        id=f"{model_name} {variant}")


CASES = [*(case("llama4", name) for name in VARIANTS),
         *(case("qwen3_moe", name) for name in ("full AC", "selective op AC", "compile"))]


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[list[float], list[list[float]]]]:
    return {name: train(name) for name in MODELS}


@pytest.mark.parametrize("model_name, transforms", CASES)
def test_transform_trains_the_debug_moe_as_the_plain_model_does(model_name, transforms, plain):
    losses, biases = train(model_name, **transforms)
    assert biases == plain[model_name][1]  # the same tokens went to the same experts at every step
    assert max(abs(a - b) for a, b in zip(losses, plain[model_name][0])) < 1e-5, (losses, plain[model_name][0])
