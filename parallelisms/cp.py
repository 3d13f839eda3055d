"""Context parallelism: split the sequence of every sample across the ranks of a CP group.

`shard_sequence` cuts a sequence into 2·cp chunks, rank r holding chunks r and 2·cp − 1 − r (equal
causal work), and returns each token's global position. `ContextParallelAttention` replaces the
model's `CausalAttention` core: it all-gathers K and V (autograd-aware), runs SDPA per local query
chunk with a lower-right causal mask, and masks packed documents by their gathered ids. `apply_cp`
serves transformers models through their attention registry; it runs on any process group, gloo
included. The design (Llama 3's approach), its traffic, masks and compile: docs/parallelism.md.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from weft.errors import TransformError, refuse_data_parallel_model
from weft.layers.attention import CausalAttention, document_mask, masked_attention, use_flex_attention

logger = logging.getLogger("weft")

__all__ = ["ContextParallelAttention", "apply_cp", "load_balanced_indices", "shard_sequence"]

# The autograd-aware all-gather (its backward is a reduce-scatter): newer PyTorch releases name it
# all_gather_single_autograd and deprecate the older all_gather_tensor_autograd.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


# causal_lower_right masks by (q_len, kv_len). A CausalBias is a Tensor subclass that PyTorch can
# create neither while a TorchDispatchMode is active (CommDebugMode, FlopCounterMode, ...) nor
# inside torch.compile(fullgraph=True). So masks are built in eager code, with those modes set
# aside: `shard_sequence` builds the ones its rank will need, and compiled regions look them up.
_LOWER_RIGHT_MASKS: dict[tuple[int, int], CausalBias] = {}


def _lower_right_causal_mask(q_len: int, kv_len: int) -> CausalBias:
    """causal_lower_right(q_len, kv_len), built once, outside any dispatch mode, then shared."""
    mask = _LOWER_RIGHT_MASKS.get((q_len, kv_len))
    if mask is not None:
        return mask
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"no causal mask for {q_len} × {kv_len} yet: call shard_sequence before a compiled forward"
        )
    with _disable_current_modes():
        mask = _LOWER_RIGHT_MASKS[(q_len, kv_len)] = causal_lower_right(q_len, kv_len)
    return mask


def _held_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global indices of the two chunks (of 2·cp) that a rank holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks r and 2·cp − 1 − r of 2·cp, int64 [seq_len / cp]."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism needs training.seq_len divisible by 2·cp = {2 * cp_size}, got seq_len {seq_len}"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the CP group of size {cp_size}")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(j * chunk, (j + 1) * chunk) for j in _held_chunks(cp_size, cp_rank)])


def shard_sequence(
    cp_mesh: DeviceMesh, *tensors: torch.Tensor, seq_dim: int = 1
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's load-balanced shard of each tensor along `seq_dim`, and the global positions it holds.

    Pass the positions to `Transformer.forward(tokens, positions)`. All tensors must share the
    sequence length (e.g. inputs and labels).
    """
    if not tensors:
        raise ValueError("shard_sequence needs at least one tensor to shard")
    lengths = {t.shape[seq_dim] for t in tensors}
    if len(lengths) != 1:
        raise ValueError(f"shard_sequence needs tensors of one sequence length, got {sorted(lengths)}")
    seq_len, cp_size, cp_rank = lengths.pop(), cp_mesh.size(), cp_mesh.get_local_rank()
    positions = _device_indices(seq_len, cp_size, cp_rank, tensors[0].device)
    chunk = seq_len // (2 * cp_size)
    for j in _held_chunks(cp_size, cp_rank):  # ready for the attention cores, compiled or not
        _lower_right_causal_mask(chunk, (j + 1) * chunk)
    shards = [t.index_select(seq_dim, _device_indices(seq_len, cp_size, cp_rank, t.device)) for t in tensors]
    return shards, positions


@functools.lru_cache(maxsize=16)
def _device_indices(seq_len: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """`load_balanced_indices` on `device`, made once: every micro-batch reuses it instead of copying
    it from pageable host memory (a synchronising copy on a GPU). Read-only by every user."""
    return load_balanced_indices(seq_len, cp_size, cp_rank).to(device)


class ContextParallelAttention(nn.Module):
    """Exact causal attention over a sequence sharded by `shard_sequence` across `cp_mesh`.

    A drop-in replacement for `CausalAttention`: q [batch, n_heads, s, head_dim], k and v
    [batch, n_kv_heads, s, head_dim] hold this rank's s = S / cp tokens (two chunks, in the
    load-balanced layout); the output [batch, n_heads, s, head_dim] is in the same layout.
    """

    def __init__(self, cp_mesh: DeviceMesh):
        super().__init__()
        if cp_mesh.ndim != 1:
            raise ValueError(f"ContextParallelAttention needs a 1-D CP mesh, got {cp_mesh.ndim} dimensions")
        self.cp_mesh = cp_mesh  # not its ProcessGroup, which cannot be deep-copied
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        document_ids: torch.Tensor | None = None,
        mask=None,
    ) -> torch.Tensor:
        """softmax(q kᵀ · scale + causal mask) v, where k and v range over the whole sequence;
        scale defaults to 1/√head_dim.

        document_ids: this rank's shard ([batch, s], from `shard_sequence`) of each token's
        document; the mask is then block-causal over the whole sequence. mask: those masks,
        built once per micro-batch by `document_mask` (then document_ids are not read).
        """
        local_len = q.shape[-2]
        # Checked before the collective, and equal on every rank, so a bad shape cannot hang a peer.
        if k.shape[-2] != local_len or v.shape[-2] != local_len or local_len % 2:
            raise ValueError(
                "context-parallel attention needs equal, even local lengths (two chunks per rank), got "
                f"q {local_len}, k {k.shape[-2]}, v {v.shape[-2]}"
            )
        chunk = local_len // 2
        k_all, v_all = self._gather_kv(k, v, chunk)
        if mask is None and document_ids is not None:
            mask = self.document_mask(document_ids)
        outputs = []
        for slot, j in enumerate(_held_chunks(self.cp_size, self.cp_rank)):
            q_chunk = q[..., slot * chunk : (slot + 1) * chunk, :]
            kv_len = (j + 1) * chunk
            if mask is not None:
                outputs.append(masked_attention(q_chunk, k_all[..., :kv_len, :], v_all[..., :kv_len, :], mask[slot],
                                                scale=scale))
                continue
            outputs.append(
                F.scaled_dot_product_attention(
                    q_chunk,
                    k_all[..., :kv_len, :],
                    v_all[..., :kv_len, :],
                    attn_mask=_lower_right_causal_mask(chunk, kv_len),
                    scale=scale,
                    enable_gqa=True,
                )
            )
        return torch.cat(outputs, dim=-2)

    def document_mask(self, document_ids: torch.Tensor) -> tuple:
        """The masks `forward` takes for this rank's shard of document ids, one per local query
        chunk against the keys before it: block-causal over the whole sequence (the ids all-gathered
        over the CP group once), FlexAttention block masks on CUDA. Built once per micro-batch, by
        `Transformer.forward` before the blocks."""
        chunk = document_ids.shape[-1] // 2
        docs_all = self._gather_documents(document_ids, chunk)
        flex = use_flex_attention(document_ids.device)
        return tuple(
            document_mask(document_ids[:, slot * chunk : (slot + 1) * chunk], docs_all[:, : (j + 1) * chunk], flex=flex)
            for slot, j in enumerate(_held_chunks(self.cp_size, self.cp_rank))
        )

    def _gather_documents(self, document_ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """Every rank's document ids, in global order, to mask against the gathered K/V."""
        return _gather_documents_impl(document_ids, chunk, self.cp_mesh)

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather K and V (one collective) and return them over the whole sequence, in global order."""
        kv = _all_gather_autograd(torch.stack((k, v)), gather_dim=3, group=self.cp_mesh)  # [2, b, h, S, d]
        # Gathered in rank order, rank r contributing chunks (r, 2·cp − 1 − r). Global order is the
        # first chunk of ranks 0..cp−1, then the second chunk of ranks cp−1..0.
        by_rank = kv.unflatten(3, (self.cp_size, 2, chunk))  # [2, b, h, rank, slot, chunk, d]
        ordered = torch.cat((by_rank[:, :, :, :, 0], by_rank[:, :, :, :, 1].flip(3)), dim=3).flatten(3, 4)
        return ordered[0], ordered[1]


def _gather_documents_impl(document_ids: torch.Tensor, chunk: int, cp_mesh: DeviceMesh) -> torch.Tensor:
    """All-gather the document ids [batch, s] of the CP group and return them in global order."""
    cp_size = cp_mesh.size()
    gathered = funcol.all_gather_tensor(document_ids.contiguous(), gather_dim=1, group=cp_mesh)  # [b, cp·s]
    by_rank = gathered.unflatten(1, (cp_size, 2, chunk))  # [b, rank, slot, chunk]
    return torch.cat((by_rank[:, :, 0], by_rank[:, :, 1].flip(1)), dim=1).flatten(1, 2)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make the model's causal attention see the whole sequence across `cp_mesh`; return the model.

    weft's models: every `CausalAttention` core (wherever it sits) becomes a
    `ContextParallelAttention`; a subclass is refused, as it may mask differently. transformers
    models using "sdpa" or "eager" attention: their attention layers dispatch to the
    context-parallel core through transformers' attention registry. Inputs must then be sharded
    with `shard_sequence`, and its positions passed to the model.

    Apply after float8 and tensor parallelism, before activation checkpointing, compile and
    FSDP/DDP.
    """
    refuse_data_parallel_model(model, "apply_cp")
    cores = [
        (parent, name, f"{parent_name}.{name}".lstrip("."), child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, CausalAttention)
    ]
    if not cores:
        if _is_transformers_model(model):
            return _apply_cp_transformers(model, cp_mesh)
        raise TransformError(
            "apply_cp", "model",
            f"found no attention to make context-parallel in {type(model).__name__}: route its causal "
            "attention through weft's CausalAttention module (weft.layers.attention), or use a transformers model",
        )
    for _, _, path, core in cores:  # validate everything before changing anything
        if type(core) is not CausalAttention:
            raise TransformError(
                "apply_cp", "model",
                f"cannot replace {path} ({type(core).__name__}): context parallelism supports only the plain "
                "causal core CausalAttention",
            )
    for parent, name, _, _ in cores:
        setattr(parent, name, ContextParallelAttention(cp_mesh))
    logger.info(f"apply_cp: {len(cores)} attention cores see the whole sequence over cp_mesh size {cp_mesh.size()} "
                "(K/V all-gather, load-balanced chunks)")
    return model


# ---------------------------------------------------------------------------------------------
# transformers models
# ---------------------------------------------------------------------------------------------

_HF_ATTENTION = "weft_context_parallel"


def _is_transformers_model(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "_attn_implementation") and hasattr(model, "set_attn_implementation")


def _apply_cp_transformers(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Point a transformers model's attention at weft's context-parallel core."""
    config = model.config
    current = config._attn_implementation
    if current not in ("sdpa", "eager", _HF_ATTENTION):
        raise TransformError(
            "apply_cp", "model", f"{type(model).__name__} uses attention {current!r}; context parallelism "
            "replaces 'sdpa' or 'eager' attention only"
        )
    for name in ("sliding_window", "attn_logit_softcapping", "attention_dropout"):
        if getattr(config, name, None):
            raise TransformError(
                "apply_cp", "model", f"{type(model).__name__} sets {name}; the context-parallel core is plain causal"
            )
    layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "layer_idx")]
    if not layers or not all(m.is_causal for m in layers):
        raise TransformError(
            "apply_cp", "model", f"{type(model).__name__} has no causal attention layers (is_causal, layer_idx)"
        )
    _register_transformers_attention()
    for layer in layers:
        layer.context_parallel_core = ContextParallelAttention(cp_mesh)
    model.set_attn_implementation(_HF_ATTENTION)
    logger.info(f"apply_cp: {len(layers)} attention layers of {type(model).__name__} see the whole sequence over "
                f"cp_mesh size {cp_mesh.size()} (K/V all-gather, load-balanced chunks)")
    return model


def _register_transformers_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_HF_ATTENTION, _transformers_attention)
    AttentionMaskInterface.register(_HF_ATTENTION, _no_mask)


def _transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: [b, h, s, d] in, ([b, s, h, d], None) out."""
    if dropout or kwargs.get("is_causal") is False:
        raise ValueError("context-parallel attention is causal and has no dropout")
    out = module.context_parallel_core(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The context-parallel core applies the causal mask over global positions itself."""
    return None
