"""weft's Llama 4 as the rest of weft sees it (models/common/spec.py): flavors, build, pipeline units
(the decoder's: the embedding, each block, the norm with the output), Hugging Face mapping (with the
experts' joined gate_up_proj and Meta's `language_model.` prefix), tensor-parallel plan, FLOPs per
token, LoRA adapters per block."""

from __future__ import annotations

from weft.models.common.counts import attention_lora_numel, attention_numel, decoder_flops_per_token
from weft.models.common.decoder_spec import decoder_spec
from weft.models.common.hf_config import hf_mapping
from weft.models.common.spec import Experts
from weft.models.llama4 import hf_mapping as llama4_hf
from weft.models.llama4.args import LLAMA4_FLAVORS, ModelArgs
from weft.models.llama4.model import Transformer
from weft.models.llama4.tp_plan import tp_plan


def flops_per_token(args: ModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·H·Q·ΣT_l (forward + backward).

    N: the parameters a token uses (the active ones: `Transformer.active_parameters`) that take
    part in matrix multiplies, all but the token embedding unless tied. The second term is
    attention's score and value products, H heads of size Q, each layer l over its context T_l:
    the sequence, or a rotary layer's chunk where that is shorter.
    """
    context = sum(args.attended_context(layer, seq_len) for layer in range(args.n_layers))
    return decoder_flops_per_token(args, n_params, seq_len, context)


def block_numel(args: ModelArgs) -> int:
    """Parameters of one block, averaged over the MoE and dense blocks."""
    attention = attention_numel(args) + 2 * args.dim
    moe = 3 * args.dim * args.expert_hidden_dim * (args.n_experts + 1) + args.dim * args.n_experts
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    dense = 3 * args.dim * args.dense_hidden_dim
    return attention + (n_moe * moe + (args.n_layers - n_moe) * dense) // args.n_layers


def lora_block_numel(args: ModelArgs, rank: int) -> int:
    """Adapter parameters of one block, averaged over the MoE and dense blocks, with LoRA on the
    default targets: attention's 4 linears and the feed-forward's 3 (the shared expert's in an MoE
    block; not the router, not the stacked routed experts), rank x (in + out) each."""
    h, n_moe = args.dim, sum(args.is_moe_layer(i) for i in range(args.n_layers))
    feed_forward = 3 * (n_moe * (h + args.expert_hidden_dim) + (args.n_layers - n_moe) * (h + args.dense_hidden_dim))
    return attention_lora_numel(args, rank) + rank * feed_forward // args.n_layers


def attention_chunk(args: ModelArgs, layer: int) -> int | None:
    """The chunk a layer attends within: rotary layers' `attention_chunk_size`; NoPE layers see the whole past."""
    return args.attention_chunk_size if args.uses_rope(layer) else None


def experts(args: ModelArgs) -> Experts:
    return Experts(args.n_experts, args.top_k, args.routed_hidden_dim, args.routed_slots)


LLAMA4_HF = hf_mapping(llama4_hf, ["llama4_text", "llama4"], join=llama4_hf.to_hf_tensor, split=llama4_hf.from_hf_tensor,
                       hf_shape=llama4_hf.hf_shape, weight_prefix=llama4_hf.weight_prefix,
                       expert_parameters=llama4_hf.EXPERT_PARAMETERS)

LLAMA4_SPEC = decoder_spec("Llama 4", LLAMA4_FLAVORS, ModelArgs, Transformer, LLAMA4_HF, tp_plan=tp_plan,
                           flops_per_token=flops_per_token, block_numel=block_numel, lora_block_numel=lora_block_numel,
                           experts=experts, active_parameters=Transformer.active_parameters,
                           attention_chunk=attention_chunk)
