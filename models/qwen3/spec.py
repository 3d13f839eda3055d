"""weft's Qwen3 and Qwen3-MoE as the rest of weft sees it (models/common/spec.py), one spec for both:
flavors, build, pipeline units (the decoder's), Hugging Face mapping (per-head q/k norm rows,
per-expert tensors), tensor-parallel plan, FLOPs per token, LoRA adapters per block, and what
differs between its dense and MoE models: experts and routing, active parameters, NF4, PEFT targets."""

from __future__ import annotations

from weft.models.common.counts import attention_lora_numel, attention_numel
from weft.models.common.decoder_spec import decoder_spec
from weft.models.common.hf_config import hf_mapping
from weft.models.common.spec import Experts, Refusals
from weft.models.qwen3 import hf_mapping as qwen3_hf
from weft.models.qwen3.args import QWEN3_FLAVORS, ModelArgs
from weft.models.qwen3.model import Transformer
from weft.models.qwen3.tp_plan import tp_plan


def block_numel(args: ModelArgs) -> int:
    """Parameters of one block, averaged over the MoE and dense blocks: attention with its q/k norms,
    the two norms, and the dense SwiGLU or the router and routed experts."""
    attention = attention_numel(args) + 2 * args.head_dim + 2 * args.dim
    moe = 3 * args.dim * args.moe_hidden_dim * args.n_experts + args.dim * args.n_experts
    dense = 3 * args.dim * args.dense_hidden_dim
    n_moe = args.n_moe_layers
    return attention + (n_moe * moe + (args.n_layers - n_moe) * dense) // args.n_layers


def lora_block_numel(args: ModelArgs, rank: int) -> int:
    """Adapter parameters of one block, averaged over the MoE and dense blocks, with LoRA on the
    default targets: attention's 4 linears, and a dense block's 3 feed-forward linears (not the
    router, not the stacked routed experts), rank x (in + out) each."""
    dense = 3 * (args.dim + args.dense_hidden_dim) * (args.n_layers - args.n_moe_layers)
    return attention_lora_numel(args, rank) + rank * dense // args.n_layers


def experts(args: ModelArgs) -> Experts | None:
    """Qwen3-MoE's routing; None for a dense Qwen3."""
    return Experts(args.n_experts, args.top_k, args.routed_hidden_dim, args.routed_slots) if args.n_experts else None


def peft_refusal(args: ModelArgs, adapted: list[str]) -> str | None:
    """PEFT (0.21, with transformers 5) reads a Qwen3-MoE adapter's gate_proj / up_proj / down_proj
    targets as the fused routed experts', so adapters on a dense layer's SwiGLU (mlp_only_layers)
    would not load there (checked again with peft 0.21.2: `gate_proj` alone is refused as "fused into
    gate_up_proj"); dense Qwen3 loads any adapter. Adapters on the routed experts themselves are not
    in `adapted` (LoRALinear names only) and go out as `target_parameters` (components/hf/writer.py)."""
    dense_mlp = [name for name in adapted if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")]
    if not args.n_experts or not dense_mlp:
        return None
    return (f"PEFT reads a Qwen3-MoE adapter's gate_proj/up_proj/down_proj as its fused experts', so the adapter on "
            f"{dense_mlp[0]} (a dense layer's SwiGLU) would not load there; set lora.target_modules to the attention "
            "(wq, wk, wv, wo)")


QWEN3_HF = hf_mapping(qwen3_hf, qwen3_hf.MODEL_TYPES, expert_parameters=qwen3_hf.EXPERT_PARAMETERS)

QWEN3_SPEC = decoder_spec("Qwen3", QWEN3_FLAVORS, ModelArgs, Transformer, QWEN3_HF, tp_plan=tp_plan,
                          block_numel=block_numel, lora_block_numel=lora_block_numel, experts=experts,
                          active_parameters=Transformer.active_parameters, refusals=Refusals(peft=peft_refusal))
