"""weft's Llama as the rest of weft sees it (models/spec.py): flavors, build, TP plan, pipeline
units, Hugging Face mapping, FLOPs per token."""

from __future__ import annotations

from weft.models.common.hf_config import hf_mapping
from weft.models.common.pipeline import decoder_units
from weft.models.common.tp_plan import dense_tp_plan
from weft.models.llama import hf_mapping as llama_hf
from weft.models.llama.args import LLAMA_FLAVORS, ModelArgs
from weft.models.llama.model import Transformer
from weft.models.spec import ModelSpec


def flops_per_token(args: ModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·H·Q·T (forward + backward).

    N counts the parameters that take part in matrix multiplies: all but the token embedding
    (a lookup), unless it is tied to the output projection. The second term is attention's
    score and value products: L layers, H heads of size Q, context length T.
    """
    embedding = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return 6 * (n_params - embedding) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def block_numel(args: ModelArgs) -> int:
    """Parameters of one block: wq, wk, wv, wo, w1, w2, w3 and the two norms."""
    attention = args.dim * (2 * args.n_heads * args.head_dim + 2 * args.kv_heads * args.head_dim)
    return attention + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim


def lora_block_numel(args: ModelArgs, rank: int) -> int:
    """Adapter parameters of one block with LoRA on its 7 linears: rank x (in + out) each."""
    q, kv, h, f = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim, args.ffn_hidden_dim
    return rank * ((h + q) * 2 + (h + kv) * 2 + 3 * (h + f))


LLAMA_HF = hf_mapping(llama_hf, ["llama"])

LLAMA_SPEC = ModelSpec(
    name="Llama",
    flavors=LLAMA_FLAVORS,
    args_type=ModelArgs,
    model_type=Transformer,
    build=Transformer,
    tp_plan=dense_tp_plan,
    pipeline_units=decoder_units,
    hf=LLAMA_HF,
    flops_per_token=flops_per_token,
    block_numel=block_numel,
    lora_block_numel=lora_block_numel,
)
