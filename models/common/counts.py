"""Counts every decoder family's spec makes alike: training FLOPs per token (MFU) and the
parameters of grouped-query attention, whole and as LoRA adapters (the memory estimate)."""

from __future__ import annotations


def decoder_flops_per_token(args, n_params: int, seq_len: int, context: int | None = None) -> float:
    """Training FLOPs per token: 6·N + 12·H·Q·ΣT_l (forward + backward).

    N counts the parameters a token uses (an MoE's active ones) that take part in matrix
    multiplies: all but the token embedding (a lookup), unless it is tied to the output projection.
    The second term is attention's score and value products: H heads of size Q, each layer l over
    its context T_l. context: ΣT_l; by default every layer attends over the whole sequence (L·T).
    """
    embedding = 0 if args.tie_embeddings else args.vocab_size * args.dim
    context = args.n_layers * seq_len if context is None else context
    return 6 * (n_params - embedding) + 12 * args.n_heads * args.head_dim * context


def attention_numel(args) -> int:
    """Parameters of one block's attention projections: wq, wk, wv, wo."""
    return args.dim * (2 * args.n_heads * args.head_dim + 2 * args.kv_heads * args.head_dim)


def attention_lora_numel(args, rank: int) -> int:
    """Adapter parameters on one block's 4 attention projections: rank x (in + out) each."""
    q, kv, h = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim
    return rank * ((h + q) * 2 + (h + kv) * 2)
