"""weft's Llama as the rest of weft sees it (models/common/spec.py): flavors, build, TP plan, pipeline
units, Hugging Face mapping, FLOPs per token."""

from __future__ import annotations

from weft.models.common.counts import attention_lora_numel, attention_numel
from weft.models.common.decoder_spec import decoder_spec
from weft.models.common.hf_config import hf_mapping
from weft.models.llama import hf_mapping as llama_hf
from weft.models.llama.args import LLAMA_FLAVORS, ModelArgs
from weft.models.llama.model import Transformer


def block_numel(args: ModelArgs) -> int:
    """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 and the two norms."""
    return attention_numel(args) + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim


def lora_block_numel(args: ModelArgs, rank: int) -> int:
    """Adapter parameters of one block with LoRA on its 7 linears: rank x (in + out) each."""
    return attention_lora_numel(args, rank) + rank * 3 * (args.dim + args.ffn_hidden_dim)


LLAMA_HF = hf_mapping(llama_hf, ["llama"])

LLAMA_SPEC = decoder_spec("Llama", LLAMA_FLAVORS, ModelArgs, Transformer, LLAMA_HF, block_numel=block_numel,
                          lora_block_numel=lora_block_numel)
