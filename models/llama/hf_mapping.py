"""Llama in Hugging Face's terms (`LlamaForCausalLM`): the name table, config.json.

Besides the names, two things differ between weft's Llama and transformers': the rotary row
order of wq and wk (the table's `ROTARY_ROWS`, models/common/hf_names.py), and tied embeddings
(Hugging Face stores no `lm_head.weight` when `tie_word_embeddings` is set).

Nothing here reads or writes files; components/hf does, through the family's `HFMapping`.
"""

from __future__ import annotations

from typing import Any

import torch

from weft.models.common.hf_config import check_values, decoder_hf_config, refuse_unsupported, required, rope_scaling
from weft.models.common.hf_names import (
    DECODER_BLOCK,
    ROTARY_ROWS,
    HFNames,
    decoder_table,
    permute_for_hf,
    swiglu,
    unpermute_from_hf,
)
from weft.models.common.spec import HFConfigError
from weft.models.llama.args import ModelArgs

__all__ = [
    "HFConfigError",
    "NAMES",
    "architecture_fields",
    "from_hf_tensor",
    "hf_config",
    "hf_to_weft_name",
    "model_args_from_hf_config",
    "permute_for_hf",
    "to_hf_tensor",
    "unpermute_from_hf",
    "weft_to_hf_name",
]

NAMES = HFNames(decoder_table(DECODER_BLOCK | swiglu("feed_forward", "mlp")), rotary_rows=ROTARY_ROWS)
weft_to_hf_name = NAMES.to_hf  # `layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight`
hf_to_weft_name = NAMES.to_weft
to_hf_tensor = NAMES.to_hf_tensor  # weft name, tensor, args: wq/wk rows permuted for rotate_half
from_hf_tensor = NAMES.from_hf_tensor


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with the shape and rotary settings of `args`."""
    config = decoder_hf_config(args, dtype, "LlamaForCausalLM", "llama")
    return config | {"intermediate_size": args.ffn_hidden_dim, "mlp_bias": False}


# Fields weft's Llama has no counterpart for, with the one value it matches (transformers' default).
_FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("attention_dropout", 0.0))


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Llama config.json that decide the model's function, with transformers'
    defaults filled in. Raises HFConfigError, naming the field and its value, for a model weft's
    Llama cannot represent: another architecture, biases, an activation other than SiLU, dropout
    or a rotary scaling other than Llama 3's."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise HFConfigError(f"model_type is {model_type}, not llama")
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise HFConfigError(f"architectures is {architectures}, not LlamaForCausalLM")
    refuse_unsupported(config, _FIXED, "Llama")
    check_values(config)
    scaling, rope = rope_scaling(config, "Llama")
    hidden = required(config, "hidden_size")
    heads = required(config, "num_attention_heads")
    return {
        "hidden_size": hidden,
        "intermediate_size": required(config, "intermediate_size"),
        "num_hidden_layers": required(config, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "vocab_size": required(config, "vocab_size"),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        "rope_scaling": scaling,
    }


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of a Hugging Face Llama `config.json` (as a dict): every field weft's Llama
    represents, an explicit head_dim and intermediate_size included."""
    a = architecture_fields(config)
    hidden, heads = a["hidden_size"], a["num_attention_heads"]
    try:
        return ModelArgs(
            dim=hidden,
            n_layers=a["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=a["num_key_value_heads"],
            vocab_size=a["vocab_size"],
            norm_eps=a["rms_norm_eps"],
            rope_theta=a["rope_theta"],
            rope_scaling=a["rope_scaling"],
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=a["tie_word_embeddings"],
            explicit_head_dim=None if a["head_dim"] * heads == hidden else a["head_dim"],
            explicit_ffn_hidden_dim=a["intermediate_size"],
        )
    except ValueError as e:  # head counts that do not divide, an odd head_dim
        raise HFConfigError(str(e)) from None
