"""The names of a transformers model's parameters in its folder, where transformers converts the
folder's tensors on load (`transformers.conversion_mapping`): DeepSeek V3, GLM-4 MoE, Qwen3-MoE and
Mixtral store one tensor per expert, which transformers stacks into `experts.gate_up_proj` (gate
and up joined along the output features) and `experts.down_proj`; Mixtral also renames
`block_sparse_moe` to `mlp` (transformers' own renaming code renames here); Kimi Linear joins its
q, k and v convolutions into one (`_Join`). `ConvertedNames` maps each parameter to the folder's
tensors both ways, so a rank loads only the experts it holds and the export writes the folder's
own key set."""

from __future__ import annotations

import functools
import re

import torch

from weft.models.common.spec import HFConfigError

_PLAIN = re.compile(r"[\w.*]+")  # a converter's pattern read as text (its dots match dots); `*`: the expert


def _text(pattern: str) -> str:
    """A converter's pattern with its escaped dots (`\\.experts`, DeepSeek V4's) as plain dots."""
    return pattern.replace("\\.", ".")


class _Stack:
    """One parameter stacked from per-expert tensors: `sources` (`experts.*.gate_proj.weight`, ...)
    joined along each expert's output features in order, making `target` (`experts.gate_up_proj`)."""

    def __init__(self, sources: list[str], target: str):
        self.sources = [s.strip(".") for s in sources]
        self.target = target.strip(".")

    def prefix(self, name: str) -> str | None:
        """What precedes the target in the parameter `name`; None where `name` is not one."""
        if name == self.target or name.endswith("." + self.target):
            return name[:len(name) - len(self.target)]
        return None


class _Join(_Stack):
    """One parameter made of whole tensors joined along its first dimension, in equal parts (Kimi
    Linear's `conv1d` of `q_conv1d`, `k_conv1d`, `v_conv1d`), as transformers splits it back on save."""


class ConvertedNames:
    """`HFNames`' interface (models/common/hf_names.py) for a transformers model whose folder holds
    `stacks`' per-expert tensors, its names changed by transformers' `renamings` (in load order):
    each other parameter is one tensor, under its own name renamed as transformers saves it."""

    def __init__(self, stacks: list[_Stack], renamings: list, joins: list[_Join] = ()):
        from transformers.core_model_loading import apply_renamings

        self.stacks, self.joins = stacks, list(joins)
        self._rename = apply_renamings
        self._load, self._save = renamings, [r.reverse_transform() for r in renamings[::-1]]

    def _stack(self, name: str) -> tuple[list[str], str] | None:
        """The folder's patterns whose per-expert tensors make the parameter `name`, in the order they
        join, and what precedes them; None for a parameter of one tensor."""
        for stack in self.stacks:
            prefix = stack.prefix(name)
            if prefix is not None:
                return stack.sources, prefix
        return None

    def holds_grouped_experts(self) -> bool:
        """Whether the folder's per-expert tensors make both `gate_up_proj` and `down_proj` (what
        weft's grouped experts hold in transformers' place: experts.py)."""
        return {s.target.rsplit(".", 1)[-1] for s in self.stacks} >= {"gate_up_proj", "down_proj"}

    def _join(self, name: str) -> tuple[list[str], str] | None:
        """The folder's tensors joined into the parameter `name`, and what precedes them; None where it is not one."""
        for join in self.joins:
            prefix = join.prefix(name)
            if prefix is not None:
                return join.sources, prefix
        return None

    def to_hf(self, name: str) -> str:
        if self._stack(name) is not None or self._join(name) is not None:
            raise ValueError(f"parameter {name!r} is held by several tensors: see hf_parts")
        return self._rename(name, self._save)

    def to_weft(self, hf_name: str) -> str:
        name = self._rename(hf_name, self._load)
        for stack in self.stacks:
            for source in stack.sources:
                head, tail = source.split("*")
                match = re.fullmatch(rf"(.*?){re.escape(head)}\d+{re.escape(tail)}", name)
                if match:
                    return match.group(1) + stack.target
        for join in self.joins:
            for source in join.sources:
                if name == source or name.endswith("." + source):
                    return name[:len(name) - len(source)] + join.target
        return name

    def hf_parts(self, name: str, count: int) -> list[str]:
        """The folder's tensors of `name`: expert by expert, each expert's in the order they join; a
        joined parameter's (`_Join`) in the order they join."""
        joined = self._join(name)
        if joined is not None:
            sources, prefix = joined
            return [self._rename(prefix + source, self._save) for source in sources]
        found = self._stack(name)
        if found is None:
            return [self.to_hf(name)]
        sources, prefix = found
        return [self._rename(prefix + source.replace("*", str(e)), self._save)
                for e in range(count) for source in sources]

    def stacked(self, name: str) -> bool:
        return self._stack(name) is not None

    def groups(self, weft_names) -> dict[str, list[str]]:
        return {name if self.stacked(name) or self._join(name) else self.to_hf(name): [name] for name in weft_names}

    def to_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor

    def from_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor


@functools.lru_cache(maxsize=32)
def converted_names(model_type: str, architecture: str = "") -> ConvertedNames | None:
    """The names of `model_type`'s folders as transformers saves them, where it converts them on
    load (the conversions of the class `architecture` where transformers lists that class, as
    GPTNeoXForCausalLM's `embed_out`, else the model_type's); None where each parameter is its
    folder's tensor of the same name. As transformers' own save, it leaves out the prefix changes
    (which it cannot tell were there). HFConfigError, naming the family and the conversion, for one
    this backend does not make."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        PrefixChange,
        WeightConverter,
        WeightRenaming,
    )

    stacks, renamings, joins = [], [], []
    conversions = (architecture and get_checkpoint_conversion_mapping(architecture)) or \
        get_checkpoint_conversion_mapping(model_type)
    for conversion in conversions or ():
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        plain = all(_PLAIN.fullmatch(_text(p)) for p in sources + targets)
        operations = [(type(op), getattr(op, "dim", None)) for op in getattr(conversion, "operations", ())]
        if isinstance(conversion, PrefixChange):
            continue
        if isinstance(conversion, WeightConverter):
            stacking = operations in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)])
            one_target = plain and len(targets) == 1 and "*" not in targets[0]
            if stacking and one_target and all(p.count("*") == 1 for p in sources):
                stacks.append(_Stack([_text(p) for p in sources], _text(targets[0])))
                continue
            if operations == [(Concatenate, 0)] and one_target and not any("*" in p for p in sources):
                joins.append(_Join([_text(p) for p in sources], _text(targets[0])))
                continue
        elif isinstance(conversion, WeightRenaming):
            renamings.append(conversion)
            continue
        raise HFConfigError(f"model_type {model_type}: transformers converts its checkpoint's tensors on load "
                            f"({', '.join(sources)} -> {', '.join(targets)}, {type(conversion).__name__} "
                            f"{[op.__name__ for op, _ in operations]}) in a way the transformers backend does not "
                            "make yet")
    return ConvertedNames(stacks, renamings, joins) if stacks or renamings or joins else None
