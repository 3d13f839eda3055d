"""What every decoder family's Hugging Face mapping shares besides the name table: the config.json
fields they all write, the reading of rotary scaling in both of transformers' formats, the
refusal of fields weft has no counterpart for and of sizes and rotary values no model has, and
the wiring of a family's `HFMapping`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from weft.models.common.rotary import RopeScaling
from weft.models.common.spec import HFConfigError, HFMapping


def hf_mapping(family: ModuleType, model_types: Iterable[str], **tensor_layout) -> HFMapping:
    """The `HFMapping` of a family's hf_mapping module, which defines `NAMES` (its `HFNames`),
    `hf_config`, `model_args_from_hf_config` and `architecture_fields`. `tensor_layout`: HFMapping's
    join, split, hf_shape and weight_prefix, where the family's tensors differ beyond the rotary rows."""
    return HFMapping(model_types=tuple(model_types), names=family.NAMES, hf_config=family.hf_config,
                     args_from_hf_config=_reading_config_alone(family.model_args_from_hf_config),
                     architecture_fields=family.architecture_fields, **tensor_layout)


def _reading_config_alone(read: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """A family's config.json reader as HFMapping calls it: the folder and trust_remote_code it is
    given are the transformers backend's to use; weft's families read config.json alone."""
    return lambda config, *, trust_remote_code=False, folder="": read(config)


def decoder_hf_config(args, dtype: torch.dtype, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json fields every decoder family writes alike, from any family's `args`."""
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
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


def required(config: dict[str, Any], key: str) -> Any:
    """config[key], or HFConfigError naming it."""
    if key not in config:
        raise HFConfigError(f"config.json has no {key}")
    return config[key]


def refuse_unsupported(config: dict[str, Any], fixed: Iterable[tuple[str, Any]], family: str) -> None:
    """HFConfigError naming the first of `fixed` (field, the one value weft matches) set otherwise."""
    for key, supported in fixed:
        if config.get(key, supported) != supported:
            raise HFConfigError(f"{key} is {config[key]}; weft's {family} supports only {supported}")


# The config.json fields of weft's families that count something (a width, heads, layers, tokens):
# each, where set, a positive integer. transformers accepts 0 or less for most of them and then
# fails in the forward, divides by zero, or computes something else (a window of 0 sees no key).
SIZES = ("hidden_size", "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
         "num_local_experts", "num_experts", "num_experts_per_tok", "sliding_window", "attention_chunk_size",
         "interleave_moe_layer_step", "no_rope_layer_interval", "decoder_sparse_step", "floor_scale")
# Rotary values that divide or are raised to a power: each, where set, a positive finite number.
ROPE_VALUES = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
               "original_max_position_embeddings")


def check_values(config: dict[str, Any]) -> None:
    """HFConfigError naming the first of SIZES that is not a positive integer, the first rotary
    value (top level, in `rope_scaling` or in `rope_parameters`) that is not a positive finite
    number, or a Llama 3 scaling whose high_freq_factor is not above its low_freq_factor."""
    for key in SIZES:
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise HFConfigError(f"{key} is {value!r}; expected a positive integer")
    ropes = {"": config} | {f"{key}.": config[key] for key in ("rope_scaling", "rope_parameters")
                            if isinstance(config.get(key), dict)}
    for prefix, rope in ropes.items():
        for key in ROPE_VALUES:
            value = rope.get(key)
            if value is not None and (type(value) not in (int, float) or not 0 < value < math.inf):
                raise HFConfigError(f"{prefix}{key} is {value!r}; expected a positive number")
        low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
        if low is not None and high is not None and high <= low:
            raise HFConfigError(f"{prefix}high_freq_factor is {high}; expected more than low_freq_factor ({low})")


def rope_scaling(config: dict[str, Any], family: str) -> tuple[RopeScaling | None, dict[str, Any]]:
    """(weft's scaling, the rotary dict) of either format: `rope_scaling` + `rope_theta`
    (transformers 4) or `rope_parameters` (transformers 5, which holds rope_theta too). weft
    implements the default rotary and Llama 3's scaling; any other rope_type is refused."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, rope
    if rope_type != "llama3":
        raise HFConfigError(f"{key}.rope_type is {rope_type}; weft's {family} implements default and llama3")
    try:
        return RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
        ), rope
    except KeyError as e:
        raise HFConfigError(f"{key} of rope_type llama3 has no {e.args[0]}") from None
