"""weft parameter names ↔ Hugging Face tensor names, both ways from one table of patterns, and the
row order Hugging Face's rotary needs.

A pattern's `{layer}` and, on the Hugging Face side, `{expert}` (one tensor per expert of a stacked
weft parameter; `hf_parts` names them) stand for integers; several weft patterns naming one Hugging
Face pattern make that tensor together, in table order (`groups`). `permute_for_hf` reorders the
rows of wq and wk (and per-head q/k norm weights) within each head, evens first then odds, since
weft rotates adjacent channels and transformers' `rotate_half` halves (docs/checkpoints.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

_FIELD = re.compile(r"\{(\w+)\}")

# Outside the blocks, the same in every decoder family.
DECODER_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# A block's attention and its two norms, the same in every decoder family.
DECODER_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Rows to reorder for `rotate_half`: weft name suffix -> the ModelArgs field giving its heads.
ROTARY_ROWS = {"attention.wq.weight": "n_heads", "attention.wk.weight": "kv_heads"}


def swiglu(weft: str, hf: str) -> dict[str, str]:
    """A SwiGLU's three projections under the prefixes `weft` and `hf` (w1 gate, w2 down, w3 up)."""
    return {f"{weft}.w1.weight": f"{hf}.gate_proj.weight", f"{weft}.w2.weight": f"{hf}.down_proj.weight",
            f"{weft}.w3.weight": f"{hf}.up_proj.weight"}


def decoder_table(block: Mapping[str, str]) -> dict[str, str]:
    """The full table of a decoder: `DECODER_TOP_LEVEL`, then `block` (names inside a block, as
    `DECODER_BLOCK` and the family's feed-forward) under `layers.{layer}.` / `model.layers.{layer}.`."""
    return DECODER_TOP_LEVEL | {f"layers.{{layer}}.{weft}": f"model.layers.{{layer}}.{hf}" for weft, hf in block.items()}


def _regex(pattern: str) -> re.Pattern:
    pieces = _FIELD.split(pattern)  # literal, field, literal, field, ...
    return re.compile("".join(re.escape(p) if i % 2 == 0 else rf"(?P<{p}>\d+)" for i, p in enumerate(pieces)))


class HFNames:
    """Both translators of one table (weft pattern -> Hugging Face pattern, see the module's
    docstring), with the rotary row order of `rotary_rows` (weft name suffix -> the ModelArgs
    field, or the number, of heads its rows hold). `weft_only`: patterns of weft tensors Hugging
    Face has no place for (an MoE layer's balancing bias), which `groups` leaves out."""

    def __init__(self, table: Mapping[str, str], *, rotary_rows: Mapping[str, str | int] | None = None,
                 weft_only: Iterable[str] = ()):
        self.table = dict(table)
        self.rotary_rows = dict(rotary_rows or {})
        self._entries = [(_regex(weft), _regex(hf), hf, set(_FIELD.findall(hf)) - set(_FIELD.findall(weft)))
                         for weft, hf in self.table.items()]
        self._weft_only = [_regex(pattern) for pattern in weft_only]

    def _entry(self, name: str):
        for index, (weft, _, hf, stacked_by) in enumerate(self._entries):
            match = weft.fullmatch(name)
            if match:
                return index, match.groupdict(), hf, stacked_by
        raise ValueError(f"no Hugging Face name for weft parameter {name!r}")

    def to_hf(self, name: str) -> str:
        """`layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight`."""
        _, fields, hf, stacked_by = self._entry(name)
        if stacked_by:
            raise ValueError(f"weft parameter {name!r} is held by several Hugging Face tensors ({hf}): see hf_parts")
        return hf.format(**fields)

    def to_weft(self, hf_name: str) -> str:
        """`model.layers.3.self_attn.q_proj.weight` → `layers.3.attention.wq.weight`; a tensor that is
        part of a weft parameter gives that parameter (gate_up_proj: its w1, an expert's: the stack)."""
        for (_, hf, _, _), weft in zip(self._entries, self.table):
            match = hf.fullmatch(hf_name)
            if match:
                return weft.format(**match.groupdict())
        raise ValueError(f"no weft name for Hugging Face tensor {hf_name!r}")

    def hf_parts(self, name: str, count: int) -> list[str]:
        """The Hugging Face tensors that hold the weft parameter `name`, stacked along its first
        dimension of size `count` in this order (one per expert); [to_hf(name)] where it is one."""
        _, fields, hf, stacked_by = self._entry(name)
        if not stacked_by:
            return [hf.format(**fields)]
        (field,) = stacked_by
        return [hf.format(**fields, **{field: i}) for i in range(count)]

    def stacked(self, name: str) -> bool:
        """Whether Hugging Face holds the weft parameter `name` as one tensor per expert (`hf_parts`)."""
        return bool(self._entry(name)[3])

    def groups(self, weft_names: Iterable[str]) -> dict[str, list[str]]:
        """Each Hugging Face tensor's name → the weft parameters it is made of, in table order, the
        tensors in the order of `weft_names`; `weft_only` tensors left out. A weft parameter held
        as one tensor per expert is a group of its own, under the name of its tensors with the
        expert left as `{expert}` (`hf_parts` names them)."""
        groups: dict[str, list[tuple[int, str]]] = {}
        for name in weft_names:
            if any(pattern.fullmatch(name) for pattern in self._weft_only):
                continue
            index, fields, hf, stacked_by = self._entry(name)
            key = hf.format(**fields, **{field: f"{{{field}}}" for field in stacked_by})
            groups.setdefault(key, []).append((index, name))
        return {hf: [name for _, name in sorted(members)] for hf, members in groups.items()}

    def rotary_heads(self, name: str, args) -> int | None:
        """How many heads the rows of `name` hold, where they are reordered for `rotate_half`."""
        for suffix, heads in self.rotary_rows.items():
            if name.endswith(suffix):
                return getattr(args, heads) if isinstance(heads, str) else heads
        return None

    def to_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        """A weft parameter's values in its Hugging Face row order."""
        heads = self.rotary_heads(name, args)
        return tensor if heads is None else permute_for_hf(tensor, heads)

    def from_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        """A Hugging Face tensor's values in the row order of the weft parameter `name`."""
        heads = self.rotary_heads(name, args)
        return tensor if heads is None else unpermute_from_hf(tensor, heads)


def permute_for_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a weft wq/wk ([n_heads·head_dim, dim]; or a [head_dim] norm weight,
    one head) for `rotate_half`.

    Within each head, weft row 2i + c (pair i, c = 0 or 1) becomes row c·head_dim/2 + i: the
    even rows first, then the odd ones, so that HF's pair (i, i + head_dim/2) is weft's pair
    (2i, 2i + 1), rotated by the same frequency.
    """
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_hf`: HF q_proj/k_proj rows back to weft's adjacent-pair order."""
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


class ExpertParameters:
    """How transformers holds the routed experts in memory, which is what PEFT's `target_parameters`
    name and adapt, whatever the files hold (Qwen3-MoE's files keep one tensor per expert, its
    model one stacked `gate_up_proj`). `table`: weft pattern of a stacked expert weight ->
    transformers' 3-D parameter; several weft patterns naming one parameter are joined along its
    output features in table order (gate, then up; as wide as each other), and the parameters come
    in the table in the order their module defines them (PEFT nests its wrappers in that order).
    `x_at_w`: each expert's matrix is [in, out], used as x @ W (Llama 4), not [out, in] as in
    F.linear (Qwen3-MoE), as PEFT lays its factors out for the module. `interleaved`: the joined
    weights alternate feature by feature (gpt-oss: gate in the even features of gate_up_proj, up in
    the odd) instead of following each other."""

    def __init__(self, table: Mapping[str, str], *, x_at_w: bool, interleaved: bool = False):
        self.names = HFNames(table)
        self.x_at_w = x_at_w
        self.interleaved = interleaved
        self.order = list(dict.fromkeys(hf.rsplit(".", 1)[-1] for hf in table.values()))

    def covers(self, name: str) -> bool:
        """Whether `name` is a stacked expert weight of the table."""
        return any(weft.fullmatch(name) for weft, *_ in self.names._entries)

    def parameter(self, name: str) -> str:
        """`layers.1.feed_forward.experts.w1` -> `model.layers.1.feed_forward.experts.gate_up_proj`."""
        return self.names.to_hf(name)

    def joined(self, name: str) -> list[str]:
        """The weft weights, in table order, that make the parameter holding `name` (`name` among them)."""
        _, fields, _, _ = self.names._entry(name)
        hf = self.parameter(name)
        return [weft.format(**fields) for weft, their_hf in self.names.table.items() if their_hf.format(**fields) == hf]

    def target(self, name: str) -> str:
        """PEFT's `target_parameters` entry for the parameter holding `name`, the same in every layer
        (`feed_forward.experts.gate_up_proj`)."""
        return self.parameter(name).split(".layers.", 1)[-1].split(".", 1)[-1]
