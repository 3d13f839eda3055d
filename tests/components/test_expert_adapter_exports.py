"""LoRA on the routed experts (`--lora.target_modules wq,wv,experts`) exported, on tiny Llama 4 and
Qwen3-MoE models built by transformers: the PEFT folder (`target_parameters` beside
`target_modules`) loads in PEFT onto transformers' model with weft's logits and with those of the
merged folder read by transformers, and loads back onto weft's base for generation, the same again."""

from __future__ import annotations

import json

import pytest
import torch

from weft.components.hf import load_hf_into_model, model_args_from_hf_folder
from weft.components.hf.adapters import load_peft_adapter
from weft.components.hf.writer import save_hf_model, save_peft_adapter
from weft.parallelisms.lora import LoRAOptions, apply_lora, expert_lora_modules, lora_modules

from tests.support.hf_folders import tiny_qwen3_hf_folder
from tests.support.llama4_transformers import tiny_transformers_model, weft_from_transformers

TARGETS = ["wq", "wv", "experts"]


def _llama4(folder):
    hf = tiny_transformers_model(seed=5)
    return hf, weft_from_transformers(hf)


def _qwen3_moe(folder):
    from weft.models.qwen3 import Transformer

    hf = tiny_qwen3_hf_folder(folder, moe=True)
    model = Transformer(model_args_from_hf_folder(folder))
    load_hf_into_model(model, folder)
    return hf, model.eval()


@pytest.fixture(scope="module", params=[_llama4, _qwen3_moe], ids=["llama4", "qwen3_moe"])
def trained(request, tmp_path_factory):
    """(a builder of fresh (transformers' base, weft's base), weft's model with every adapter away
    from its init, tokens, weft's logits, the folder holding the PEFT and merged exports)."""
    root = tmp_path_factory.mktemp(request.param.__name__)
    hf, model = request.param(root / "hf")
    apply_lora(model, LoRAOptions(rank=4, alpha=8.0, target_modules=TARGETS))
    assert expert_lora_modules(model), "the routed experts must carry adapters"
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
        for _, module in expert_lora_modules(model):
            for b in module.lora_B.parameters():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
        tokens = torch.randint(0, model.args.vocab_size, (2, 30), generator=generator)
        logits = model(tokens)
        assert (hf(tokens).logits - logits).abs().max() > 1e-2, "the adapters must change the logits"
    save_peft_adapter(model, root / "adapter")
    save_hf_model(model, root / "merged")
    return lambda: request.param(root / "fresh"), model, tokens, logits, root


def test_the_peft_folder_names_the_experts_as_target_parameters(trained):
    *_, root = trained
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    experts = "feed_forward.experts" if "llama4" in root.name else "mlp.experts"
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["target_parameters"] == [f"{experts}.gate_up_proj", f"{experts}.down_proj"]
    assert config["rank_pattern"] == {"gate_up_proj": 8} and config["alpha_pattern"] == {"gate_up_proj": 16.0}


def test_peft_and_the_merged_folder_give_weft_logits(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, _, tokens, logits, root = trained
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base()[0], root / "adapter").eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(root / "merged", attn_implementation="eager").float().eval()
        merged_logits = merged(input_ids=tokens).logits
    torch.testing.assert_close(peft_logits, merged_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(peft_logits, logits, rtol=0, atol=1e-5)


def test_the_peft_folder_loads_back_onto_weft_base(trained):
    base, _, tokens, logits, root = trained
    model = load_peft_adapter(base()[1], root / "adapter")
    assert expert_lora_modules(model)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("build", [_llama4, _qwen3_moe], ids=["llama4", "qwen3_moe"])
def test_an_adapter_peft_itself_made_loads_onto_weft_with_peft_logits(build, tmp_path):
    """PEFT's own adapter on the fused experts (one rank-3 gate_up adapter, no block structure) and
    on v_proj, drawn at random: weft's read-back (the same A for gate and up, B split) computes
    what PEFT computes."""
    from peft import LoraConfig, get_peft_model

    hf, model = build(tmp_path / "hf")
    experts = "feed_forward.experts" if build is _llama4 else "mlp.experts"
    peft_model = get_peft_model(hf, LoraConfig(r=3, lora_alpha=5, target_modules=["v_proj"], lora_dropout=0.0,
                                               target_parameters=[f"{experts}.gate_up_proj", f"{experts}.down_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        peft_model.save_pretrained(tmp_path / "adapter")
        tokens = torch.randint(0, model.args.vocab_size, (2, 30), generator=generator)
        theirs = peft_model.eval()(input_ids=tokens).logits
        assert (theirs - model(tokens)).abs().max() > 1e-2, "the adapters must change the logits"
        torch.testing.assert_close(load_peft_adapter(model, tmp_path / "adapter")(tokens), theirs, rtol=0, atol=1e-5)


def test_qlora_merged_folder_folds_expert_adapters_into_the_nf4_experts(tmp_path):
    """QLoRA with expert adapters: the merged folder holds the NF4 experts as the weights they hold
    plus each expert's scaling · B_e A_e, and transformers reads it with weft's QLoRA logits."""
    from transformers import Llama4ForCausalLM

    from weft.parallelisms.lora import dequantize_experts, quantize_lora_base

    nf4_sized = dict(hidden_size=256, head_dim=64, intermediate_size=128)  # whole groups of NF4 scales
    model = apply_lora(weft_from_transformers(tiny_transformers_model(seed=5, **nf4_sized)),
                       LoRAOptions(rank=4, alpha=8.0, target_modules=TARGETS, quantize_base="nf4"))
    quantize_lora_base(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, module in expert_lora_modules(model):
            for b in module.lora_B.parameters():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
        tokens = torch.randint(0, model.args.vocab_size, (2, 20), generator=generator)
        logits = model(tokens)
    save_hf_model(dequantize_experts(model), tmp_path / "merged")
    merged = Llama4ForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        # 5e-5 on logits up to 6: fp32 rounding at dim 256, as for QLoRA's merged folder without expert adapters
        torch.testing.assert_close(merged(input_ids=tokens).logits, logits, rtol=0, atol=5e-5)
        for _, module in expert_lora_modules(model):
            for b in module.lora_B.parameters():
                b.zero_()
        assert (model(tokens) - logits).abs().max() > 1e-3, "the expert adapters must change the logits"
