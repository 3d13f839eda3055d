"""A tiny transformers Llama4ForCausalLM with every Llama 4 feature, and the way between it and
weft's Llama 4 (weights copied through weft's name mapping), for the tests that compare the two."""

import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

from weft.models.llama4 import ModelArgs, Transformer
from weft.models.llama4.hf_mapping import (
    from_hf_tensor,
    hf_config,
    hf_groups,
    model_args_from_hf_config,
    to_hf_tensor,
    weft_to_hf_name,
)


def transformers_config(args: ModelArgs, **extra) -> Llama4TextConfig:
    """transformers' text config of weft's Llama 4 `args`, with `extra` fields."""
    fields = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return Llama4TextConfig(**fields, **extra)


# Every Llama 4 feature at once: 4 experts (top 2) with a shared expert in layers 1 and 3, NoPE
# layers 1 and 3 with temperature tuning that changes every 4 positions, rotary layers 0 and 2
# with QK norm and chunks of 8 positions (sequences of 30 cross 3 chunk borders), llama3 scaling.
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
            vocab_size=128, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4,
            num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2,
            attention_chunk_size=8, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4,
            attn_scale=0.5, max_position_embeddings=64,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def tiny_transformers_model(seed: int = 0, **overrides) -> Llama4ForCausalLM:
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(Llama4TextConfig(**{**TINY, **overrides}, attn_implementation="eager")).float()
    with torch.no_grad():  # transformers' std 0.02 gives near-zero logits and router scores: spread them
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if "router" in name else 0.1)
    return model.eval()


def weft_from_transformers(hf: Llama4ForCausalLM) -> Transformer:
    model = Transformer(model_args_from_hf_config(hf.config.to_dict()))
    hf_state = hf.state_dict()
    missing, unexpected = model.load_state_dict(
        {n: from_hf_tensor(n, hf_state[weft_to_hf_name(n)]) for n, _ in model.named_parameters()}, strict=False)
    assert not unexpected and all(n.endswith("feed_forward.expert_bias") for n in missing)  # zero: no balancing yet
    return model.eval()


def transformers_from_weft(model: Transformer) -> Llama4ForCausalLM:
    hf = Llama4ForCausalLM(transformers_config(model.args, attn_implementation="eager")).float()
    state = dict(model.named_parameters())
    hf.load_state_dict({hf_name: to_hf_tensor(names, [state[n] for n in names])
                        for hf_name, names in hf_groups(state).items()})
    return hf.eval()
