"""Qwen3 and Qwen3-MoE in Hugging Face's terms (`Qwen3ForCausalLM`, model_type `qwen3`;
`Qwen3MoeForCausalLM`, model_type `qwen3_moe`): the name table and config.json.

Beyond the names: the rotary row order of wq, wk and the q/k norm weights; tied embeddings (no
`lm_head.weight`); and the routed experts, one stacked parameter per projection in weft and one
2-D tensor per expert on disk (the table's `{expert}` field). Nothing here reads or writes files;
components/hf does, through the family's `HFMapping` (docs/qwen3.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from weft.models.common.hf_config import check_values, decoder_hf_config, refuse_unsupported, required, rope_scaling
from weft.models.common.hf_names import DECODER_BLOCK, ROTARY_ROWS, ExpertParameters, HFNames, decoder_table, swiglu
from weft.models.common.spec import HFConfigError
from weft.models.qwen3.args import ModelArgs

QK_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}

NAMES = HFNames(
    decoder_table(
        DECODER_BLOCK
        | QK_NORMS
        | swiglu("feed_forward", "mlp")  # dense layers
        | {  # MoE layers
            "feed_forward.router.weight": "mlp.gate.weight",
            "feed_forward.experts.w1": "mlp.experts.{expert}.gate_proj.weight",
            "feed_forward.experts.w2": "mlp.experts.{expert}.down_proj.weight",
            "feed_forward.experts.w3": "mlp.experts.{expert}.up_proj.weight",
        }
    ),
    # The q/k norm weights are one head's rows: reordered like each head of wq and wk.
    rotary_rows=ROTARY_ROWS | {"attention.q_norm.weight": 1, "attention.k_norm.weight": 1},
    weft_only=["layers.{layer}.feed_forward.expert_bias"],  # weft's balancing state; transformers has none
)

# The experts as transformers 5's Qwen3MoeExperts holds them in memory, fused although the files keep
# one tensor per expert: gate_up_proj [experts, 2·hidden, dim] and down_proj [experts, dim, hidden],
# each expert's matrix used as in F.linear (x @ W.T).
EXPERT_PARAMETERS = ExpertParameters({
    "layers.{layer}.feed_forward.experts.w1": "model.layers.{layer}.mlp.experts.gate_up_proj",
    "layers.{layer}.feed_forward.experts.w3": "model.layers.{layer}.mlp.experts.gate_up_proj",
    "layers.{layer}.feed_forward.experts.w2": "model.layers.{layer}.mlp.experts.down_proj",
}, x_at_w=False)

MODEL_TYPES = ("qwen3", "qwen3_moe")


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `Qwen3ForCausalLM` (no experts) or `Qwen3MoeForCausalLM` computing what
    a weft Qwen3 of `args` computes."""
    no_window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers,
                 "attention_dropout": 0.0, "intermediate_size": args.dense_hidden_dim}
    if not args.n_experts:
        return decoder_hf_config(args, dtype, "Qwen3ForCausalLM", "qwen3") | no_window
    return decoder_hf_config(args, dtype, "Qwen3MoeForCausalLM", "qwen3_moe") | no_window | {
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
    }


# Fields weft's Qwen3 has no counterpart for, with the one value it matches.
_FIXED = (("hidden_act", "silu"), ("attention_bias", False), ("attention_dropout", 0.0),
          ("use_sliding_window", False))


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelArgs fields of a Qwen3 config.json that decide the model's function (all but the
    rotary table's length); HFConfigError for one weft's Qwen3 cannot represent."""
    fields = dataclasses.asdict(model_args_from_hf_config(config))
    fields.pop("max_seq_len")
    return fields


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of a Qwen3 or Qwen3-MoE `config.json` (as a dict), transformers' defaults filled
    in. Raises HFConfigError naming the field and its value for what weft's Qwen3 does not implement:
    another architecture, biases, an activation other than SiLU, dropout, sliding-window attention,
    a rotary scaling other than Llama 3's (Qwen3's YaRN included)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFConfigError(f"model_type is {model_type}, not {' or '.join(MODEL_TYPES)}")
    refuse_unsupported(config, _FIXED, "Qwen3")
    check_values(config)
    layer_types = config.get("layer_types")
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise HFConfigError(f"layer_types is {layer_types}; weft's Qwen3 supports only full_attention layers")
    scaling, rope = rope_scaling(config, "Qwen3")
    hidden, heads = int(required(config, "hidden_size")), int(required(config, "num_attention_heads"))
    moe = model_type == "qwen3_moe"
    try:
        return ModelArgs(
            dim=hidden,
            n_layers=int(required(config, "num_hidden_layers")),
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(required(config, "vocab_size")),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_seq_len=int(config.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            dense_hidden_dim=int(config.get("intermediate_size", 22016 if not moe else 6144)),
            # num_experts in the published files, num_local_experts as transformers 5 writes it
            n_experts=int(config.get("num_experts", config.get("num_local_experts", 128))) if moe else 0,
            top_k=int(config.get("num_experts_per_tok", 8)),
            moe_hidden_dim=int(config.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
        )
    except ValueError as e:  # head counts that do not divide, an odd head_dim, top_k above the experts
        if isinstance(e, HFConfigError):
            raise
        raise HFConfigError(str(e)) from None
