"""Counts of a transformers model, read off it built on the meta device: parameters of a block and
of its adapters, training FLOPs per token, and its routed experts' routing."""

from __future__ import annotations

import functools

from torch import nn

from weft.models.common.spec import Experts, HFConfigError
from weft.models.transformers.args import HFModelArgs, attribute, config_top_k, transformers_config
from weft.models.transformers.conversions import converted_names
from weft.models.transformers.experts import grouped_experts_refusal, routed_experts
from weft.models.transformers.model import meta_model


@functools.lru_cache(maxsize=8)
def _meta_counts(args: HFModelArgs) -> tuple[int, int, int]:
    """(parameters of the blocks, their linears' inputs + outputs, those of the blocks' linears),
    from the model on meta: per block, averaged."""
    model = meta_model(args)
    blocks = _blocks(model)
    numel = sum(p.numel() for block in blocks for p in block.parameters())
    widths = sum(m.in_features + m.out_features for block in blocks for m in block.modules() if isinstance(m, nn.Linear))
    return numel // len(blocks), widths // len(blocks), len(blocks)


@functools.lru_cache(maxsize=8)
def meta_experts(args: HFModelArgs) -> tuple[int, int, int, str | None]:
    """(routed experts per MoE layer, their hidden width, MoE layers, why weft's grouped experts cannot
    take their place or None), from the model on meta."""
    model = meta_model(args)
    found = routed_experts(model)
    refusal = grouped_experts_refusal(model)
    names = converted_names(args.model_type, args.architecture)
    if found and refusal is None and (names is None or not names.holds_grouped_experts()):
        refusal = "its folder does not hold its experts one tensor per expert (gate, up and down)"
    if not found:
        return 0, 0, 0, "it has no routed experts"
    experts, rows, _ = found[0][1].gate_up_proj.shape
    return experts, rows // 2, len(found), refusal


@functools.lru_cache(maxsize=8)
def _meta_matmul_numel(args: HFModelArgs) -> float:
    """Weights a token multiplies by, from the model on meta: every parameter of two or more
    dimensions but the token embedding (a lookup; counted once more where the output projection is
    tied to it), the routed experts' at the share of them a token is sent to (top_k of n)."""
    model = meta_model(args)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    routed = {id(p): module for _, module in routed_experts(model) for p in module.parameters(recurse=False)}
    top_k = config_top_k(args.config) or 0
    numel = 0.0
    for p in model.parameters():
        if p.ndim < 2 or id(p) in embeddings:
            continue
        numel += p.numel() * (top_k / p.shape[0] if id(p) in routed else 1)
    return numel + (args.vocab_size * args.dim if args.tie_embeddings else 0)


def flops_per_token(args: HFModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token of the built model (forward and backward): 6 x the weights a token
    multiplies by (`_meta_matmul_numel`; n_params, the parameter count, is not used) plus attention's
    score and value products, 6 x H x (Q_k + Q_v) x T in each softmax-attention layer (its H heads of
    key width Q_k, value width Q_v; MLA's differ; a layer's own head_dim where per_layer_config sets
    one, as Gemma 4's global layers), the whole sequence T as the mask-taking kernels compute it; a
    linear-attention layer's recurrence is left out."""
    config = args.config
    hf_config = transformers_config(config, args.trust_remote_code, args.folder)
    q_k = attribute(hf_config, "qk_head_dim") or args.head_dim
    q_v = attribute(hf_config, "v_head_dim") or args.head_dim
    layers = config.get("layer_types") or ["full_attention"] * args.n_layers
    own = {int(i): fields["head_dim"] for i, fields in (config.get("per_layer_config") or {}).items()
           if isinstance(fields, dict) and isinstance(fields.get("head_dim"), int)}
    widths = sum(2 * own[i] if i in own else q_k + q_v for i, kind in enumerate(layers) if kind != "linear_attention")
    return 6 * _meta_matmul_numel(args) + 6 * args.n_heads * widths * seq_len


def experts(args: HFModelArgs) -> Experts | None:
    """The routing of a model whose experts weft's grouped experts can compute (`experts_refusal`);
    None for any other (dense, or experts of another arithmetic, such as gpt-oss's)."""
    n_experts, hidden, moe_layers, refusal = meta_experts(args)
    top_k = config_top_k(args.config)
    if refusal is not None or not isinstance(top_k, int):
        return None
    return Experts(n_experts, top_k, moe_layers * top_k * hidden // args.n_layers, moe_layers * top_k / args.n_layers)


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise HFConfigError(f"{type(model).__name__} has no model.layers, the decoder blocks weft looks for")
    return list(layers)


def block_numel(args: HFModelArgs) -> int:
    return _meta_counts(args)[0]


def lora_block_numel(args: HFModelArgs, rank: int) -> int:
    """Adapters of one block with LoRA on every linear of it (the default targets)."""
    return rank * _meta_counts(args)[1]
