"""PEFT adapter and merged exports (components/hf/writer.py), loaded by PEFT and transformers:
their logits must equal weft's, which computes the adapters itself."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from weft.components.hf.adapters import load_peft_adapter
from weft.components.hf.writer import ExportError, save_hf_model, save_peft_adapter
from weft.errors import UserError
from weft.models.llama import ModelArgs, Transformer
from weft.models.llama.hf_mapping import hf_config
from weft.parallelisms.lora import LoRAOptions, lora_modules
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=64)


@pytest.fixture(scope="module")
def trained():
    """weft's Llama with adapters on every block linear, B and A set away from their init."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    model = materialize(parallelize(model, None, ParallelizeOptions(lora=LoRAOptions(rank=4, alpha=8.0))), "cpu", seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12), generator=generator)
    with torch.no_grad():
        logits = model(tokens)
    return model, tokens, logits


def base_hf_model(model: Transformer):
    """The transformers model holding weft's base weights (adapters left out)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from weft.models.llama.hf_mapping import to_hf_tensor, weft_to_hf_name

    hf = LlamaForCausalLM(LlamaConfig(**hf_config(ARGS), attn_implementation="eager")).eval()
    hf.load_state_dict({weft_to_hf_name(n): to_hf_tensor(n, p.detach(), ARGS)
                        for n, p in model.named_parameters() if ".lora_" not in n})
    return hf


def test_peft_loads_the_adapter_with_weft_logits(trained, tmp_path):
    from peft import PeftModel

    model, tokens, logits = trained
    save_peft_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["r"] == 4 and config["lora_alpha"] == 8.0
    peft_model = PeftModel.from_pretrained(base_hf_model(model), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 28


def test_merged_folder_loads_in_transformers_with_weft_logits(trained, tmp_path):
    from transformers import LlamaForCausalLM

    model, tokens, logits = trained
    save_hf_model(model, tmp_path / "merged")
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = merged(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)
    base = base_hf_model(model)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=tokens, use_cache=False).logits, logits, atol=1e-3), \
            "the adapters must change the logits, or the test proves nothing"


def test_exports_refuse_an_existing_folder_and_a_model_without_adapters(trained, tmp_path):
    model, _, _ = trained
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("kept")
    with pytest.raises(UserError, match="exists and is not empty; refusing to overwrite"):
        save_peft_adapter(model, tmp_path / "taken")
    plain = materialize(_plain(), "cpu")
    with pytest.raises(ExportError, match="no LoRA adapters"):
        save_peft_adapter(plain, tmp_path / "none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def _plain() -> nn.Module:
    with torch.device("meta"):
        return Transformer(ARGS)


def test_an_adapter_folder_loads_back_onto_the_base(trained, tmp_path):
    """generate.py's path: the base's weights, then load_peft_adapter: weft's logits again."""
    model, tokens, logits = trained
    save_peft_adapter(model, tmp_path / "adapter")
    base = materialize(_plain(), "cpu")
    with torch.no_grad():
        for name, param in base.named_parameters():
            param.copy_(model.get_parameter(name))
    load_peft_adapter(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(base(tokens), logits, rtol=1e-6, atol=1e-6)
