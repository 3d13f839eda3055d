"""gpt-oss in Hugging Face's terms (`GptOssForCausalLM`, model_type `gpt_oss`): the name table, the
experts' layout and config.json.

Beyond the names: the rotary row order of wq, wk and their biases; the sinks; and the experts,
held by transformers as `gate_up_proj` [experts, dim, 2·hidden] with gate and up *interleaved*
(gate in the even columns, up in the odd), its bias [experts, 2·hidden] alike, and `down_proj`
[experts, hidden, dim], each used as x @ W. Nothing here reads or writes files; components/hf does,
through the family's `HFMapping` (docs/gpt-oss.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from weft.models.common.hf_config import check_values, decoder_hf_config, refuse_unsupported, required
from weft.models.common.hf_names import DECODER_BLOCK, ROTARY_ROWS, ExpertParameters, HFNames, decoder_table
from weft.models.common.rotary import YarnScaling
from weft.models.common.spec import HFConfigError
from weft.models.gpt_oss.args import LAYER_TYPES, ModelArgs

_BIASES = {f"attention.{w}.bias": f"self_attn.{p}_proj.bias" for w, p in zip(("wq", "wk", "wv", "wo"), "qkvo")}
_EXPERTS = {  # gate (w1) and up (w3) make gate_up_proj, their biases gate_up_proj_bias
    "feed_forward.experts.w1": "mlp.experts.gate_up_proj",
    "feed_forward.experts.w3": "mlp.experts.gate_up_proj",
    "feed_forward.experts.b1": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.b3": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.w2": "mlp.experts.down_proj",
    "feed_forward.experts.b2": "mlp.experts.down_proj_bias",
}

NAMES = HFNames(
    decoder_table(
        DECODER_BLOCK
        | _BIASES
        | {"attention.core.sinks": "self_attn.sinks",
           "feed_forward.router.weight": "mlp.router.weight",
           "feed_forward.router.bias": "mlp.router.bias"}
        | _EXPERTS
    ),
    # The q and k biases are rows of wq and wk: reordered like them.
    rotary_rows=ROTARY_ROWS | {"attention.wq.bias": "n_heads", "attention.wk.bias": "kv_heads"},
    weft_only=["layers.{layer}.feed_forward.expert_bias"],  # weft's balancing state; transformers has none
)

# transformers' GptOssExperts in memory, as in the files: what PEFT's target_parameters adapt. Its
# matrices are [in, out], but the module says so (`is_transposed`), and PEFT (0.21.2) then lays its
# factors out as for an F.linear [out, in] matrix: x_at_w False, as PEFT reads it.
EXPERT_PARAMETERS = ExpertParameters({
    f"layers.{{layer}}.{weft}": f"model.layers.{{layer}}.{hf}" for weft, hf in _EXPERTS.items()
    if weft.endswith(("w1", "w3", "w2"))
}, x_at_w=False, interleaved=True)

MODEL_TYPES = ("gpt_oss",)
_JOINED = ("experts.w1", "experts.w3", "experts.b1", "experts.b3")


def join(weft_names: list[str], tensors: list[torch.Tensor], args: ModelArgs | None = None) -> torch.Tensor:
    """The Hugging Face tensor of these weft parameters: gate and up interleaved (weights as
    [experts, in, out]), down_proj transposed, anything else as it is."""
    if weft_names[0].endswith(_JOINED):
        gate, up = (t.transpose(1, 2) if t.ndim == 3 else t for t in tensors)
        return torch.stack([gate, up], dim=-1).flatten(-2)
    if weft_names[0].endswith("experts.w2"):
        return tensors[0].transpose(1, 2)
    (tensor,) = tensors
    return tensor


def split(weft_name: str, hf_tensor: torch.Tensor, args: ModelArgs | None = None) -> torch.Tensor:
    """The weft parameter `weft_name`'s part of a Hugging Face tensor (`join`'s inverse)."""
    if weft_name.endswith(_JOINED):
        part = hf_tensor[..., 0::2] if weft_name.endswith(("w1", "b1")) else hf_tensor[..., 1::2]
        return (part.transpose(1, 2) if part.ndim == 3 else part).contiguous()
    if weft_name.endswith("experts.w2"):
        return hf_tensor.transpose(1, 2).contiguous()
    return hf_tensor


def hf_shape(weft_name: str, shape: torch.Size) -> list[int]:
    """The shape of the Hugging Face tensor holding a weft parameter of this shape."""
    if weft_name.endswith(("experts.w1", "experts.w3")):
        return [shape[0], shape[2], 2 * shape[1]]
    if weft_name.endswith(("experts.b1", "experts.b3")):
        return [shape[0], 2 * shape[1]]
    if weft_name.endswith("experts.w2"):
        return [shape[0], shape[2], shape[1]]
    return list(shape)


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `GptOssForCausalLM` computing what a weft gpt-oss of `args` computes."""
    plain = dataclasses.replace(args, rope_scaling=None)  # the shared fields; YaRN's written below
    config = decoder_hf_config(plain, dtype, "GptOssForCausalLM", "gpt_oss") | {
        "attention_bias": True,
        "attention_dropout": 0.0,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "intermediate_size": args.moe_hidden_dim,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "sliding_window": args.sliding_window,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }
    s = args.rope_scaling
    if s is not None:
        config["rope_scaling"] = {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                                  "beta_slow": s.beta_slow, "truncate": s.truncate,
                                  "original_max_position_embeddings": s.original_max_seq_len}
        if s.attention_factor is not None:
            config["rope_scaling"]["attention_factor"] = s.attention_factor
    return config


_FIXED = (("hidden_act", "silu"), ("attention_bias", True), ("attention_dropout", 0.0))


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields of a gpt-oss config.json that decide the model's function (all but the
    rotary table's length)."""
    fields = dataclasses.asdict(model_args_from_hf_config(config))
    fields.pop("max_seq_len")
    return fields


def _yarn(config: dict[str, Any]) -> tuple[YarnScaling | None, float]:
    """(weft's YaRN scaling, rope_theta) of either transformers format."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    theta = float(config.get("rope_theta") or rope.get("rope_theta", 150000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, theta
    if rope_type != "yarn":
        raise HFConfigError(f"{key}.rope_type is {rope_type}; weft's gpt-oss implements default and yarn")
    for unsupported in ("mscale", "mscale_all_dim"):
        if rope.get(unsupported):
            raise HFConfigError(f"{key}.{unsupported} is {rope[unsupported]}; weft's gpt-oss implements YaRN without it")
    try:
        factor = rope.get("attention_factor")
        return YarnScaling(factor=float(rope["factor"]), beta_fast=float(rope.get("beta_fast") or 32),
                           beta_slow=float(rope.get("beta_slow") or 1),
                           original_max_seq_len=int(rope["original_max_position_embeddings"]),
                           truncate=bool(rope.get("truncate", True)),
                           attention_factor=None if factor is None else float(factor)), theta
    except KeyError as e:
        raise HFConfigError(f"{key} of rope_type yarn has no {e.args[0]}") from None


def _window(config: dict[str, Any]) -> int:
    """sliding_window (transformers' default 128 where absent): null leaves transformers' sliding
    layers without a window, which it cannot compute (0 and less: check_values)."""
    if "sliding_window" in config and config["sliding_window"] is None:
        raise HFConfigError("sliding_window is null; gpt-oss's sliding layers need a window of at least 1 token")
    return config.get("sliding_window", 128)


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of a gpt-oss `config.json` (as a dict), transformers' defaults filled in;
    HFConfigError naming the field and its value for what weft's gpt-oss does not implement."""
    if config.get("model_type") not in MODEL_TYPES:
        raise HFConfigError(f"model_type is {config.get('model_type')}, not gpt_oss")
    refuse_unsupported(config, _FIXED, "gpt-oss")
    check_values(config)
    scaling, theta = _yarn(config)
    layers = int(required(config, "num_hidden_layers"))
    layer_types = tuple(config.get("layer_types") or ())
    if layer_types == tuple(LAYER_TYPES[i % 2] for i in range(layers)):
        layer_types = ()  # transformers' default pattern
    hidden, heads = int(required(config, "hidden_size")), int(required(config, "num_attention_heads"))
    try:
        return ModelArgs(
            dim=hidden, n_layers=layers, n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(required(config, "vocab_size")),
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=theta, rope_scaling=scaling,
            max_seq_len=int(config.get("max_position_embeddings", 131072)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            n_experts=int(config.get("num_local_experts", 128)),
            top_k=int(config.get("num_experts_per_tok", 4)),
            moe_hidden_dim=int(config.get("intermediate_size", 2880)),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            sliding_window=_window(config),
            layer_types=layer_types,
        )
    except ValueError as e:
        if isinstance(e, HFConfigError):
            raise
        raise HFConfigError(str(e)) from None
