"""Llama in Hugging Face's terms: parameter names, the rotary row order of wq/wk, and config.json.

Two things differ between weft's Llama and transformers' `LlamaForCausalLM` besides the names:

- rotary pairs: weft (like Meta's reference code) rotates adjacent channels (x[2i], x[2i+1]) of
  each head; Hugging Face's `rotate_half` rotates channel i with channel i + head_dim/2. The
  attention scores agree when the rows of wq and wk are reordered within each head, evens
  first then odds (`permute_for_hf`), and back on import (`unpermute_from_hf`);
- tied embeddings: Hugging Face stores no `lm_head.weight` when `tie_word_embeddings` is set.

Nothing here reads or writes files; components/hf does, through these functions.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from weft.models.llama.args import ModelArgs, RopeScaling
from weft.models.spec import HFConfigError

__all__ = [
    "HFConfigError",
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




# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_BACK = {hf: weft for weft, hf in _TOP_LEVEL.items()}
_IN_BLOCK_BACK = {hf: weft for weft, hf in _IN_BLOCK.items()}
_WEFT_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def weft_to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight`."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _WEFT_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK:
        return f"model.layers.{match.group(1)}.{_IN_BLOCK[match.group(2)]}"
    raise ValueError(f"no Hugging Face name for weft parameter {name!r}")


def hf_to_weft_name(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `layers.3.attention.wq.weight`."""
    if name in _TOP_LEVEL_BACK:
        return _TOP_LEVEL_BACK[name]
    match = _HF_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK_BACK:
        return f"layers.{match.group(1)}.{_IN_BLOCK_BACK[match.group(2)]}"
    raise ValueError(f"no weft name for Hugging Face tensor {name!r}")


# ---------------------------------------------------------------------------------------------
# Tensors: the rotary row order of wq and wk
# ---------------------------------------------------------------------------------------------


def permute_for_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a weft wq/wk ([n_heads·head_dim, dim]) for `rotate_half`.

    Within each head, weft row 2i + c (pair i, c = 0 or 1) becomes row c·head_dim/2 + i: the
    even rows first, then the odd ones, so that HF's pair (i, i + head_dim/2) is weft's pair
    (2i, 2i + 1), rotated by the same frequency.
    """
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_hf`: HF q_proj/k_proj rows back to weft's adjacent-pair order."""
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _rotary_heads(weft_name: str, args: ModelArgs) -> int | None:
    """Heads to permute over for wq (query heads) and wk (key/value heads); None otherwise."""
    if weft_name.endswith("attention.wq.weight"):
        return args.n_heads
    if weft_name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def to_hf_tensor(weft_name: str, weight: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """A weft parameter's values laid out as its Hugging Face counterpart."""
    heads = _rotary_heads(weft_name, args)
    return weight if heads is None else permute_for_hf(weight, heads)


def from_hf_tensor(weft_name: str, weight: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """A Hugging Face tensor's values laid out as the weft parameter `weft_name`."""
    heads = _rotary_heads(weft_name, args)
    return weight if heads is None else unpermute_from_hf(weight, heads)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with the shape and rotary settings of `args`."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return config


def _required(config: dict[str, Any], key: str) -> Any:
    if key not in config:
        raise HFConfigError(f"config.json has no {key}")
    return config[key]


# Fields weft's Llama has no counterpart for, with the one value it matches (transformers' default).
_FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("attention_dropout", 0.0))


def _rope_scaling(config: dict[str, Any]) -> tuple[RopeScaling | None, dict[str, Any]]:
    """(weft's scaling, the rotary dict) of either format: `rope_scaling` + `rope_theta`
    (transformers 4) or `rope_parameters` (transformers 5, which holds rope_theta too)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, rope
    if rope_type != "llama3":
        raise HFConfigError(f"{key}.rope_type is {rope_type}; weft's Llama implements default and llama3")
    try:
        return RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
        ), rope
    except KeyError as e:
        raise HFConfigError(f"{key} of rope_type llama3 has no {e.args[0]}") from None


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
    for key, supported in _FIXED:
        if config.get(key, supported) != supported:
            raise HFConfigError(f"{key} is {config[key]}; weft's Llama supports only {supported}")
    scaling, rope = _rope_scaling(config)
    hidden = _required(config, "hidden_size")
    heads = _required(config, "num_attention_heads")
    return {
        "hidden_size": hidden,
        "intermediate_size": _required(config, "intermediate_size"),
        "num_hidden_layers": _required(config, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "vocab_size": _required(config, "vocab_size"),
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
