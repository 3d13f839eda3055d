"""weft's KV cache: how weft's families decode (`Backend.decoding`, models/common/spec.py).

`start` swaps each block's attention core (the module context parallelism swaps) for a
`CachedAttention` that keeps that layer's keys and values in a tensor allocated once ([batch,
kv_heads, max_len, head_dim], written at the next slots) and attends with a mask built from the
positions of queries and keys: the key is valid (no left padding, no token of a stopped row), at or
before the query, within the layer's sliding window (gpt-oss) or its chunk (Llama 4's rotary
layers, `ModelSpec.attention_chunk`), with gpt-oss's sinks. A padding query attends to itself only.
`finish` puts the original cores back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.layers.attention import CausalAttention, SinkAttention, sink_attention


class KVCache:
    """What the cached cores of one batch share: each slot's position and validity, the forward's
    slots and masks (one per window and chunk), and the cores swapped. The first forward (the
    prefill) attends over the slots it writes; every later one over all max_len slots, the unwritten
    ones masked, so that each decode step has the same shapes (torch.compile, CUDA graphs)."""

    def __init__(self, batch: int, max_len: int, device: torch.device):
        self.batch, self.max_len = batch, max_len
        self.key_positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.end = 0  # slots written
        self.span = 0  # slots the forward under way attends over
        self.slots = None  # the slots the forward under way writes: [s]
        self.masks: dict[tuple[int | None, int | None], torch.Tensor] = {}
        self.last_only = None  # the hook keeping the last position only
        self.swapped: list[tuple[nn.Module, str, nn.Module, CachedAttention]] = []  # (parent, name, original, cached)

    def append(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Take the positions and validity [batch, s] of the next s tokens (the forward's queries)."""
        s = positions.shape[1]
        if self.end + s > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {self.end} + {s} do not fit")
        self.key_positions[:, self.end:self.end + s] = positions
        self.key_valid[:, self.end:self.end + s] = valid
        self.slots = torch.arange(self.end, self.end + s, device=positions.device)
        self.end += s
        self.span = self.end if self.span == 0 else self.max_len
        self.masks = {kind: self.mask(*kind, positions, valid) for kind in {(c.window, c.chunk) for *_, c in self.swapped}}

    def mask(self, window: int | None, chunk: int | None, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Boolean [batch, 1, s, span] (True: attend) of queries at `positions` over the slots: the key
        valid, at or before the query, within the window and the chunk; a padding query its own slot."""
        q, k = positions[:, :, None], self.key_positions[:, None, :self.span]
        allowed = self.key_valid[:, None, :self.span] & (k <= q)
        if window is not None:
            allowed &= q - k < window
        if chunk is not None:
            allowed &= q // chunk == k // chunk
        own = torch.arange(self.span, device=q.device)[None, :] == self.slots[:, None]
        return torch.where(valid[:, :, None], allowed, own)[:, None]

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's keys and values (allocated at the first forward) and the slots' state."""
        tensors = [self.key_positions, self.key_valid]
        tensors += [t for *_, core in self.swapped for t in (core.keys, core.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class CachedAttention(nn.Module):
    """An attention core reading and writing one layer's keys and values in `cache`: q [batch,
    heads, s, head_dim] over every slot written so far, k and v of the s new tokens appended. Takes
    the calls of the core it replaces (`CausalAttention`'s and `SinkAttention`'s) and ignores their
    masks, which it builds from positions instead (its `document_mask` and `masks` build none)."""

    def __init__(self, cache: KVCache, window: int | None = None, chunk: int | None = None,
                 sinks: SinkAttention | None = None):
        super().__init__()
        self.cache, self.window, self.chunk = cache, window, chunk
        self.sink_core = [sinks]  # a list: not a submodule (its sinks stay the original core's)
        self.keys = self.values = None

    def document_mask(self, document_ids: torch.Tensor) -> None:
        return None

    def masks(self, *_) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids=None, mask=None) -> torch.Tensor:
        cache = self.cache
        if self.keys is None:
            shape = (cache.batch, k.shape[1], cache.max_len, k.shape[3])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        self.keys.index_copy_(2, cache.slots, k)
        self.values.index_copy_(2, cache.slots, v)
        keys, values = self.keys[:, :, :cache.span], self.values[:, :, :cache.span]
        mask = cache.masks[self.window, self.chunk]
        if self.sink_core[0] is not None:
            return sink_attention(q, keys, values, self.sink_core[0].local_sinks(), mask)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _cores(model: nn.Module) -> list[tuple[nn.Module, str, str, CausalAttention]]:
    """(parent, name, path, core) of every attention core of the model."""
    return [(parent, name, f"{path}.{name}".lstrip("."), child) for path, parent in model.named_modules()
            for name, child in parent.named_children() if isinstance(child, (CausalAttention, CachedAttention))]


def _layer(path: str) -> int:
    """The block index in a core's path (layers.<i>. ...)."""
    parts = path.split(".")
    return int(parts[parts.index("layers") + 1])


def start(model: nn.Module, batch: int, max_len: int) -> KVCache:
    """Swap every attention core of `model` for a cached one over a cache of `batch` rows of `max_len` slots."""
    cores = _cores(model)
    if any(isinstance(core, CachedAttention) for *_, core in cores):
        raise RuntimeError("the model already decodes with a KV cache (finish the other generation first)")
    device = next(iter(model.parameters())).device
    cache = KVCache(batch, max_len, device)
    chunk_of = getattr(getattr(model, "spec", None), "attention_chunk", None)
    for parent, name, path, core in cores:
        chunk = None if chunk_of is None else chunk_of(model.args, _layer(path))
        sinks = core if isinstance(core, SinkAttention) else None
        cached = CachedAttention(cache, getattr(core, "window", None), chunk, sinks)
        setattr(parent, name, cached)
        cache.swapped.append((parent, name, core, cached))
    cache.last_only = model.norm.register_forward_pre_hook(_last_position)
    return cache


def _last_position(norm: nn.Module, args: tuple) -> tuple:
    """The final norm's pre-hook while decoding: only the last position goes on to the output projection."""
    return (args[0][:, -1:], *args[1:])


def forward(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
            cache: KVCache) -> torch.Tensor:
    """Logits [batch, vocab] after the s next tokens [batch, s] at `positions`, which are appended to
    the cache; `valid` False marks tokens nothing attends to (left padding, a stopped row's)."""
    cache.append(positions, valid)
    return model(tokens, positions)[:, -1]


def finish(model: nn.Module, cache: KVCache) -> None:
    """Put the original attention cores back and free the cache."""
    for parent, name, core, cached in cache.swapped:
        setattr(parent, name, core)
        cached.keys = cached.values = None
    cache.swapped = []
    cache.last_only.remove()


def cache_bytes(args, batch: int, max_len: int, element_size: int) -> int:
    """Bytes of the cache `start` makes for `batch` rows of `max_len` slots of the model `args` (any
    family's, with n_layers, kv_heads and head_dim) in a dtype of `element_size` bytes: every layer's
    keys and values, and each slot's position (8 bytes) and validity (1 byte)."""
    return 2 * args.n_layers * batch * args.kv_heads * max_len * args.head_dim * element_size + batch * max_len * 9
