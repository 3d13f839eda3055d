"""Llama 4 in Hugging Face's terms: parameter names, the stacked experts, and config.json
(`Llama4ForCausalLM`, model_type `llama4_text`; also the text part of a
`Llama4ForConditionalGeneration`, model_type `llama4`: `text_config`, weights under `language_model.`).

Query and key rows keep their order (transformers' Llama 4 rotates adjacent pairs, as weft does).
The experts' `gate_up_proj` [experts, dim, 2·hidden] holds w1 and w3 side by side, gate first:
`NAMES` says which weft parameters make it, `to_hf_tensor` joins them, `from_hf_tensor` splits
them. Nothing here reads or writes files; components/hf does, through the family's `HFMapping`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from weft.models.common.hf_config import check_values, decoder_hf_config, refuse_unsupported, rope_scaling
from weft.models.common.hf_names import DECODER_BLOCK, ExpertParameters, HFNames, decoder_table, swiglu
from weft.models.common.spec import HFConfigError
from weft.models.llama4.args import ModelArgs

# Rotary table length when config.json asks for more: Scout's 10M positions would be a 5 GiB table.
MAX_ROTARY_POSITIONS = 131072

NAMES = HFNames(
    decoder_table(
        DECODER_BLOCK
        | swiglu("feed_forward", "feed_forward")  # dense layers
        | swiglu("feed_forward.shared_expert", "feed_forward.shared_expert")  # MoE layers
        | {
            "feed_forward.router.weight": "feed_forward.router.weight",
            "feed_forward.experts.w1": "feed_forward.experts.gate_up_proj",  # gate first, then up
            "feed_forward.experts.w3": "feed_forward.experts.gate_up_proj",
            "feed_forward.experts.w2": "feed_forward.experts.down_proj",
        }
    ),
    weft_only=["layers.{layer}.feed_forward.expert_bias"],  # weft's balancing state; transformers has none
)
weft_to_hf_name = NAMES.to_hf  # `layers.3.feed_forward.experts.w1` → `model.layers.3.feed_forward.experts.gate_up_proj`
hf_to_weft_name = NAMES.to_weft  # gate_up_proj: its w1
hf_groups = NAMES.groups  # gate_up_proj: [w1, w3]; the balancing bias left out

# The experts as transformers' Llama4TextExperts holds them (files and memory alike): gate_up_proj
# [experts, dim, 2·hidden] and down_proj [experts, hidden, dim], each expert's matrix used as x @ W.
EXPERT_PARAMETERS = ExpertParameters({
    "layers.{layer}.feed_forward.experts.w1": "model.layers.{layer}.feed_forward.experts.gate_up_proj",
    "layers.{layer}.feed_forward.experts.w3": "model.layers.{layer}.feed_forward.experts.gate_up_proj",
    "layers.{layer}.feed_forward.experts.w2": "model.layers.{layer}.feed_forward.experts.down_proj",
}, x_at_w=True)


def to_hf_tensor(weft_names: list[str], weights: list[torch.Tensor], args: ModelArgs | None = None) -> torch.Tensor:
    """The Hugging Face tensor made of these weft parameters (one, or an expert's w1 and w3).

    weft holds an expert projection as [experts, out, in] (a Linear's layout, stacked);
    Hugging Face as [experts, in, out], with gate and up joined along out."""
    if weft_names[0].endswith(("experts.w1", "experts.w2")):
        return torch.cat([w.transpose(1, 2) for w in weights], dim=-1)
    (weight,) = weights
    return weight


def from_hf_tensor(weft_name: str, hf_tensor: torch.Tensor, args: ModelArgs | None = None) -> torch.Tensor:
    """The part of a Hugging Face tensor that is the weft parameter `weft_name`."""
    if weft_name.endswith(("experts.w1", "experts.w3")):
        gate, up = hf_tensor.chunk(2, dim=-1)
        return (gate if weft_name.endswith("w1") else up).transpose(1, 2)
    if weft_name.endswith("experts.w2"):
        return hf_tensor.transpose(1, 2)
    return hf_tensor


def hf_shape(weft_name: str, shape: torch.Size) -> list[int]:
    """The shape of the Hugging Face tensor holding a weft parameter of this shape."""
    if weft_name.endswith(("experts.w1", "experts.w3")):
        return [shape[0], shape[2], 2 * shape[1]]
    if weft_name.endswith("experts.w2"):
        return [shape[0], shape[2], shape[1]]
    return list(shape)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `Llama4ForCausalLM` computing what a weft Llama 4 of `args` computes."""
    never = args.n_layers + 1  # an interval no layer reaches
    return {"rope_scaling": None} | decoder_hf_config(args, dtype, "Llama4ForCausalLM", "llama4_text") | {
        "intermediate_size": args.expert_hidden_dim,
        "intermediate_size_mlp": args.dense_hidden_dim,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "interleave_moe_layer_step": args.moe_every,
        "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)],
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
        "no_rope_layer_interval": min(args.nope_every, never),
        "attention_chunk_size": args.attention_chunk_size,
        "use_qk_norm": args.qk_norm,
        "attn_temperature_tuning": args.temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
    }


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: the file itself (`llama4_text`) or its `text_config` (`llama4`)."""
    model_type = config.get("model_type")
    if model_type == "llama4":
        if not isinstance(config.get("text_config"), dict):
            raise HFConfigError("model_type is llama4 but config.json has no text_config")
        return config["text_config"]
    if model_type != "llama4_text":
        raise HFConfigError(f"model_type is {model_type}, not llama4_text or llama4")
    return config


def weight_prefix(config: dict[str, Any]) -> str:
    """What precedes the text model's tensor names in the folder: `language_model.` in a
    `Llama4ForConditionalGeneration` folder, nothing in a `Llama4ForCausalLM` one."""
    return "language_model." if config.get("model_type") == "llama4" else ""


# Fields weft's Llama 4 has no counterpart for, with the one value it matches.
_FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0),
          ("router_jitter_noise", 0.0))


def _interval(key: str, value: Any, layers: list[int], n_layers: int, what: str) -> int:
    """k such that `layers` (indices, from the field `key` = `value`) are exactly k-1, 2k-1, ...;
    n_layers + 1 for none."""
    if not layers:
        return n_layers + 1
    k = layers[0] + 1
    if layers != list(range(k - 1, n_layers, k)):
        raise HFConfigError(f"{key} is {value}; weft's Llama 4 supports {what} layers every k-th layer only")
    return k


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields of a Llama 4 config.json that decide the model's function (all but
    the rotary table's length); HFConfigError for one weft's Llama 4 cannot represent."""
    fields = dataclasses.asdict(model_args_from_hf_config(config))
    fields.pop("max_seq_len")
    return fields


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of a Llama 4 `config.json` (as a dict). Raises HFConfigError naming the field
    and its value for what weft's Llama 4 does not implement."""
    text = text_config(config)
    refuse_unsupported(text, _FIXED, "Llama 4")
    check_values(text)
    try:
        n_layers = int(text["num_hidden_layers"])
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        step = int(text.get("interleave_moe_layer_step", 1))
        moe = text.get("moe_layers")
        moe = list(range(step - 1, n_layers, step)) if moe is None else list(moe)
        nope_interval = int(text.get("no_rope_layer_interval", 4))
        rope_flags = text.get("no_rope_layers") or [int((i + 1) % nope_interval != 0) for i in range(n_layers)]
        nope = [i for i in range(n_layers) if not rope_flags[i]]
        chunk = text.get("attention_chunk_size", 8192)
        expected_types = ["chunked_attention" if rope_flags[i] and chunk is not None else "full_attention"
                          for i in range(n_layers)]
        if text.get("layer_types") not in (None, expected_types):
            raise HFConfigError(f"layer_types is {text['layer_types']}; weft's Llama 4 expects {expected_types}")
        scaling, rope = rope_scaling(text, "Llama 4")
        experts, top_k = int(text.get("num_local_experts", 16)), int(text.get("num_experts_per_tok", 1))
        if not 1 <= top_k <= experts:
            raise HFConfigError(f"num_experts_per_tok is {top_k}; expected 1 to num_local_experts ({experts})")
        return ModelArgs(
            dim=hidden,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=int(text.get("num_key_value_heads") or heads),
            explicit_head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            rope_theta=float(text.get("rope_theta") or rope.get("rope_theta", 500000.0)),
            rope_scaling=scaling,
            max_seq_len=min(int(text.get("max_position_embeddings", 131072)), MAX_ROTARY_POSITIONS),
            tie_embeddings=bool(text.get("tie_word_embeddings", False)),
            dense_hidden_dim=int(text.get("intermediate_size_mlp", 16384)),
            expert_hidden_dim=int(text.get("intermediate_size", 8192)),
            n_experts=experts,
            top_k=top_k,
            moe_every=_interval("moe_layers", moe, moe, n_layers, "MoE"),
            nope_every=_interval("no_rope_layers", rope_flags, nope, n_layers, "NoPE"),
            attention_chunk_size=None if chunk is None else int(chunk),
            qk_norm=bool(text.get("use_qk_norm", True)),
            temperature_tuning=bool(text.get("attn_temperature_tuning", True)),
            floor_scale=int(text.get("floor_scale", 8192)),
            attn_scale=float(text.get("attn_scale", 0.1)),
        )
    except KeyError as e:
        raise HFConfigError(f"config.json has no {e.args[0]}") from None
    except ValueError as e:  # head counts that do not divide, top_k above the experts
        if isinstance(e, HFConfigError):
            raise
        raise HFConfigError(str(e)) from None
