"""LoRA on Llama 4 and its exports: adapters on the attention, the shared experts and the dense
feed-forwards of a tiny model with every Llama 4 feature. PEFT loads the adapter folder onto
transformers' Llama4ForCausalLM and transformers loads the merged folder, each with weft's
logits; the adapter folder loads back onto weft's base for generation. Routers take no
adapters, routed experts only when targeted (tests/parallelisms/test_lora_experts.py)."""

from __future__ import annotations

import pytest
import torch

from weft.components.hf.adapters import load_peft_adapter
from weft.components.hf.writer import save_hf_model, save_peft_adapter
from weft.parallelisms.lora import LoRAOptions, apply_lora, lora_modules

from tests.support.llama4_transformers import TINY, tiny_transformers_model, weft_from_transformers


@pytest.fixture(scope="module")
def trained():
    """(transformers' base, weft's model with adapters away from their init, tokens, weft's logits)."""
    hf = tiny_transformers_model(seed=5)
    model = apply_lora(weft_from_transformers(hf), LoRAOptions(rank=4, alpha=8.0))
    tokens, logits = adapters_away_from_init(model)
    with torch.no_grad():
        assert not torch.allclose(hf(tokens).logits, logits, atol=1e-3), "the adapters must change the logits"
    return hf, model, tokens, logits


@torch.no_grad()
def adapters_away_from_init(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """B drawn (seeded) instead of zero, so the adapters count; (tokens, the model's logits)."""
    generator = torch.Generator().manual_seed(6)
    for _, module in lora_modules(model):
        module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 30), generator=generator)
    return tokens, model(tokens)


def test_lora_targets_attention_shared_experts_and_dense_layers_not_routers():
    model = apply_lora(weft_from_transformers(tiny_transformers_model()), LoRAOptions(rank=4, alpha=8.0))
    targets = {name.split(".", 2)[2] for name, _ in lora_modules(model)}
    assert targets == {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                       "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",  # dense layers 0 and 2
                       "feed_forward.shared_expert.w1", "feed_forward.shared_expert.w2",
                       "feed_forward.shared_expert.w3"}
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


def test_peft_loads_the_adapter_onto_transformers_llama4_with_weft_logits(trained, tmp_path):
    from peft import PeftModel

    hf, model, tokens, logits = trained
    save_peft_adapter(model, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=tokens).logits
    peft_model.unload()  # the base goes back as it was, for the other tests
    torch.testing.assert_close(theirs, logits, rtol=0, atol=1e-5)


def test_the_merged_folder_loads_in_transformers_with_weft_logits(trained, tmp_path):
    from transformers import Llama4ForCausalLM

    _, model, tokens, logits = trained
    save_hf_model(model, tmp_path / "merged")
    merged = Llama4ForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=0, atol=1e-5)


def test_the_adapter_folder_loads_back_onto_weft_base(trained, tmp_path):
    hf, model, tokens, logits = trained
    save_peft_adapter(model, tmp_path / "adapter")
    base = load_peft_adapter(weft_from_transformers(hf), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(base(tokens), logits, rtol=0, atol=1e-6)


def test_qlora_merged_folder_writes_the_nf4_experts_as_the_weights_they_hold(tmp_path):
    """QLoRA (NF4 base, the routed experts included): the merged folder, the NF4 experts
    dequantized (recipe/export.py) and the adapters folded in, loads in transformers with the
    logits of weft's QLoRA forward."""
    from transformers import Llama4ForCausalLM

    from weft.layers.nf4_experts import NF4Experts
    from weft.parallelisms.lora import dequantize_experts, quantize_lora_base

    nf4_sized = dict(hidden_size=256, head_dim=64, intermediate_size=128)  # whole groups of NF4 scales
    model = apply_lora(weft_from_transformers(tiny_transformers_model(seed=5, **nf4_sized)),
                       LoRAOptions(rank=4, alpha=8.0, target_modules=["wq", "wv"], quantize_base="nf4"))
    quantize_lora_base(model)
    assert any(isinstance(m, NF4Experts) for m in model.modules())
    tokens, logits = adapters_away_from_init(model)
    save_hf_model(dequantize_experts(model), tmp_path / "merged")
    merged = Llama4ForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = merged(input_ids=tokens).logits
    # 5e-5 on logits up to 7.4: fp32 rounding at this width (dim 256); plain LoRA's merged folder of
    # the same model differs from weft's forward by 2.6e-5, this one by 3.4e-5
    torch.testing.assert_close(theirs, logits, rtol=0, atol=5e-5)
