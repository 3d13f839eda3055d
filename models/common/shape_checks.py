"""The shape rules every family's ModelArgs checks on creation, each refused with the values at fault."""

from __future__ import annotations


def check_heads(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Grouped-query attention shares each key/value head among whole groups of query heads, and
    rotary embeddings rotate channel pairs."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd; rotary embeddings rotate channel pairs")


def check_top_k(top_k: int, n_experts: int) -> None:
    """A token is routed to between one and all of the experts."""
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k {top_k} must lie in 1..n_experts ({n_experts})")
