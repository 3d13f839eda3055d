"""materialize: allocate a meta-device model and initialise it the model's own way, reproducibly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weft.parallelisms.materialize import materialize

from tests.support.own_models import NanoGPT, hf_llama


def meta(build):
    with torch.device("meta"):
        return build()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_transformers_model_gets_its_own_init_and_buffers():
    model = materialize(meta(hf_llama), "cpu", seed=0)
    eager = hf_llama()  # built on the CPU by transformers itself: the reference for buffers and norms
    rotary, reference_rotary = model.model.rotary_emb, eager.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, reference_rotary.inv_freq, rtol=0, atol=0)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.std().item() == pytest.approx(model.config.initializer_range, rel=0.15)


@pytest.mark.parametrize("build", [hf_llama, NanoGPT])
def test_same_seed_same_weights_other_seed_other_weights(build):
    first, again = (state(materialize(meta(build), "cpu", seed=3)) for _ in range(2))
    other = state(materialize(meta(build), "cpu", seed=4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if k.endswith("weight"))


def test_a_given_function_initialises_every_module():
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    model = materialize(meta(NanoGPT), "cpu", init=init)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())
    assert seen.count("Block") == 2 and "NanoGPT" in seen


def test_a_module_with_parameters_and_no_reset_parameters_needs_an_init():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with pytest.raises(ValueError, match="^materialize: Scale has parameters of its own but no reset_parameters"):
        materialize(meta(Scale), "cpu")


def test_cpu_offload_puts_parameters_on_the_cpu_and_buffers_on_the_device():
    """FSDP's CPU offloading needs parameters materialised on the CPU; the rotary table stays on the
    compute device. "meta" stands in for the GPU: what lands there was not put on the CPU."""
    from weft.models.llama import LLAMA_FLAVORS, Transformer
    from weft.parallelisms.materialize import materialize_devices

    assert materialize_devices("cuda:3", cpu_offload=True) == (torch.device("cpu"), torch.device("cuda:3"))
    assert materialize_devices("cuda:3", cpu_offload=False) == (torch.device("cuda:3"), torch.device("cuda:3"))
    args = LLAMA_FLAVORS["debugmodel"]
    offloaded = materialize(meta(lambda: Transformer(args)), "meta", seed=0, cpu_offload=True)
    assert {p.device.type for p in offloaded.parameters()} == {"cpu"}
    assert offloaded.rope_rotations.device.type == "meta"
    plain = materialize(meta(lambda: Transformer(args)), "cpu", seed=0)
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name  # the same initialisation, on the CPU
