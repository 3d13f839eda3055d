"""Hugging Face model folders of tiny random models (the debug model's shape, Llama 4, Qwen3), for tests
that load or fine-tune one, and a comparison of two safetensors files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def tiny_hf_folder(folder: Path, tokenizer_folder: Path) -> Path:
    """A randomly initialised transformers LlamaForCausalLM of the debug model's shape, with the tokenizer."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from weft.models.llama import LLAMA_FLAVORS
    from weft.models.llama.hf_mapping import hf_config

    torch.manual_seed(0)
    config = {k: v for k, v in hf_config(LLAMA_FLAVORS["debugmodel"]).items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder


# Every Llama 4 feature a decode crosses: 4 experts (top 2) with a shared expert in layers 1 and 3,
# NoPE layers 1 and 3 with temperature tuning that changes every 4 positions, rotary layers 0 and 2
# with QK norm and chunks of 8 positions, llama3 rotary scaling; the Shakespeare tokenizer's vocabulary.
TINY_LLAMA4 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                   vocab_size=2048, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4,
                   num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                   attention_chunk_size=8, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4,
                   attn_scale=0.5, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})


def tiny_llama4_hf_folder(folder: Path, seed: int = 0):
    """A randomly initialised transformers Llama4ForCausalLM (TINY_LLAMA4) saved in `folder`; returns
    the model. Its weights are spread (std 0.1, routers 1) so that logits and routing are far from ties."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(**TINY_LLAMA4, attn_implementation="eager")
    model = transformers.Llama4ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if "router" in name else 0.1)
    model.save_pretrained(folder)
    return model.eval()


# Qwen3 dense: tied embeddings, head_dim 32 where hidden / heads is 16, 2 query heads per key/value
# head, the Shakespeare tokenizer's vocabulary.
TINY_QWEN3 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
                  intermediate_size=80, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2)
# Qwen3-MoE: 8 experts (top 2) in layers 0, 2 and 3 (layer 1 in mlp_only_layers), as 30B-A3B does it
# (decoder_sparse_step 1); `decoder_sparse_step=2` overrides make layers 1 and 3 the MoE ones.
TINY_QWEN3_MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
                      intermediate_size=80, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], vocab_size=2048,
                      tie_word_embeddings=False, max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1,
                      eos_token_id=2)


def tiny_qwen3_hf_folder(folder: Path, moe: bool = False, seed: int = 0, **overrides):
    """A randomly initialised transformers Qwen3ForCausalLM (TINY_QWEN3), or Qwen3MoeForCausalLM
    (TINY_QWEN3_MOE), with `overrides` over its config, saved in `folder`; returns the model. Every
    weight is drawn (std 0.1; norms, the q/k norms included, around 1 with std 0.3, so that their
    row order matters; routers std 0.3, so that routing varies by token and scores are not all on one expert)."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(seed)
    if moe:
        config = transformers.Qwen3MoeConfig(**(TINY_QWEN3_MOE | overrides), attn_implementation="eager")
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**(TINY_QWEN3 | overrides), attn_implementation="eager")
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0, 0.3 if name.endswith("mlp.gate.weight") else 0.1)
    model.float().save_pretrained(folder)
    return model.float().eval()


def assert_same_tensors(a: Path, b: Path) -> None:
    """The safetensors files `a` and `b` hold the same names and, within 1e-6, the same tensors."""
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for key in ta:
        torch.testing.assert_close(tb[key], ta[key], rtol=0, atol=1e-6, msg=key)


# Every gpt-oss feature a decode crosses: a sliding layer (window 4, sequences past it) beside a
# full one, sinks and every bias random, a swiglu_limit that clamps, YaRN over 16 positions, 4
# experts (top 2); the Shakespeare tokenizer's vocabulary.
TINY_GPT_OSS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                    vocab_size=2048, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


def tiny_gpt_oss_model(seed: int = 0):
    """A randomly initialised transformers GptOssForCausalLM (TINY_GPT_OSS), float32, in eval mode.
    Weights std 0.1 (routers and sinks 1), biases random too, so that logits, routing and the clamp
    are far from ties."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY_GPT_OSS, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if ("router" in name or "sinks" in name) else 0.1)
    return model.float().eval()


def tiny_gpt_oss_hf_folder(folder: Path, seed: int = 0):
    """`tiny_gpt_oss_model` saved in `folder`; returns the model."""
    model = tiny_gpt_oss_model(seed)
    model.save_pretrained(folder)
    return model
