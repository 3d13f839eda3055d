"""weft's gpt-oss as the rest of weft sees it (models/common/spec.py): flavors, build, pipeline units
(the decoder's), Hugging Face mapping (interleaved gate/up, biases, sinks, q/k rows and biases in
rotary order), tensor-parallel plan (the MoE's, experts whole under expert parallelism), FLOPs per
token (sliding layers over their window), experts and active parameters, LoRA adapters per block."""

from __future__ import annotations

from weft.models.common.counts import attention_lora_numel, attention_numel, decoder_flops_per_token
from weft.models.common.decoder_spec import decoder_spec
from weft.models.common.hf_config import hf_mapping
from weft.models.common.spec import Experts
from weft.models.gpt_oss import hf_mapping as gpt_oss_hf
from weft.models.gpt_oss.args import GPT_OSS_FLAVORS, ModelArgs
from weft.models.gpt_oss.model import Transformer
from weft.models.gpt_oss.tp_plan import tp_plan


def flops_per_token(args: ModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (`decoder_flops_per_token`), each sliding layer attending over its
    window where that is shorter than the sequence."""
    context = sum(args.attended_context(layer, seq_len) for layer in range(args.n_layers))
    return decoder_flops_per_token(args, n_params, seq_len, context)


def block_numel(args: ModelArgs) -> int:
    """Parameters of one block: attention with its biases and sinks, two norms, the biased router
    and the experts with their biases."""
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = attention_numel(args) + q + 2 * kv + args.dim + args.n_heads + 2 * args.dim
    experts = args.n_experts * (3 * args.dim * args.moe_hidden_dim + 2 * args.moe_hidden_dim + args.dim)
    return attention + experts + (args.dim + 1) * args.n_experts


def lora_block_numel(args: ModelArgs, rank: int) -> int:
    """Adapter parameters of one block with LoRA on the default targets: attention's 4 linears (not
    the router, not the stacked experts), rank x (in + out) each."""
    return attention_lora_numel(args, rank)


def experts(args: ModelArgs) -> Experts:
    return Experts(args.n_experts, args.top_k, args.routed_hidden_dim, args.routed_slots)


GPT_OSS_HF = hf_mapping(gpt_oss_hf, gpt_oss_hf.MODEL_TYPES, join=gpt_oss_hf.join, split=gpt_oss_hf.split,
                        hf_shape=gpt_oss_hf.hf_shape, expert_parameters=gpt_oss_hf.EXPERT_PARAMETERS)

GPT_OSS_SPEC = decoder_spec("gpt-oss", GPT_OSS_FLAVORS, ModelArgs, Transformer, GPT_OSS_HF, tp_plan=tp_plan,
                            flops_per_token=flops_per_token, block_numel=block_numel,
                            lora_block_numel=lora_block_numel, experts=experts,
                            active_parameters=Transformer.active_parameters)
