"""How a transformers model and its Hugging Face folder translate into each other (HFMapping): the
parameters' own names (`SameNames`), the folder's where transformers converts it on load
(conversions.py) or where a multimodal folder holds the text model (multimodal.py), PEFT's names
of the routed experts, and config.json as the folder's own."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch

from weft.models.common.hf_names import ExpertParameters
from weft.models.common.spec import HFMapping
from weft.models.transformers.args import HFModelArgs, args_from_hf_config
from weft.models.transformers.conversions import converted_names
from weft.models.transformers.experts import TransformersRoutedExperts, routed_experts
from weft.models.transformers.model import meta_model
from weft.models.transformers.multimodal import multimodal_names
from weft.models.transformers.refusals import expert_adapters_refusal

_DTYPE_KEYS = ("torch_dtype", "dtype")


def hf_config(args: HFModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """config.json: the folder's own (a multimodal folder's whole), its dtype that of the export."""
    name = str(dtype).removeprefix("torch.")
    config = {k: v for k, v in args.folder_config.items() if k not in _DTYPE_KEYS}
    if isinstance(config.get("text_config"), dict):  # the text model's tensors are the export's dtype too
        text = config["text_config"]
        config["text_config"] = {k: name if k in _DTYPE_KEYS else v for k, v in text.items()}
    return config | {"dtype": name}


def architecture_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Every field of config.json but its dtype and the version that wrote it."""
    return {k: v for k, v in config.items() if k not in (*_DTYPE_KEYS, "transformers_version")}


class SameNames:
    """`HFNames` where weft's names are transformers' (models/common/hf_names.py): every tensor its own,
    under its own name, rows as they are."""

    def to_hf(self, name: str) -> str:
        return name

    def to_weft(self, hf_name: str) -> str:
        return hf_name

    def hf_parts(self, name: str, count: int) -> list[str]:
        return [name]

    def stacked(self, name: str) -> bool:
        return False

    def groups(self, weft_names) -> dict[str, list[str]]:
        return {name: [name] for name in weft_names}

    def to_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor

    def from_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor


def checked_field_by_field(config: dict[str, Any]) -> None:
    """`HFMapping.config_check`: nothing to check before loading, where the folder's config.json is
    compared with the model's field by field (`architecture_fields` is all of it)."""


TRANSFORMERS_HF = HFMapping(model_types=(), names=SameNames(), hf_config=hf_config,
                            args_from_hf_config=args_from_hf_config, architecture_fields=architecture_fields,
                            tied_output="lm_head.weight", config_check=checked_field_by_field)


@functools.lru_cache(maxsize=8)
def hf_mapping(args: HFModelArgs) -> HFMapping:
    """The folder's names: the parameters' own, or where transformers converts the folder on load
    (per-expert tensors stacked), the folder's (conversions.py); in a multimodal folder, the text
    model's tensors under the folder's names (multimodal.py); and where LoRA can adapt the routed
    experts, PEFT's names of them (`_expert_parameters`)."""
    if args.multimodal:
        model = meta_model(args)
        decoder = type(getattr(model, model.base_model_prefix))
        names = multimodal_names(args.config_json, args.folder, decoder, model.base_model_prefix,
                                 frozenset(model.state_dict(keep_vars=True)))
        return dataclasses.replace(TRANSFORMERS_HF, names=names)
    names = converted_names(args.model_type, args.architecture)
    mapping = TRANSFORMERS_HF if names is None else dataclasses.replace(TRANSFORMERS_HF, names=names)
    if args.output_weight != mapping.tied_output:
        mapping = dataclasses.replace(mapping, tied_output=args.output_weight)
    experts = _expert_parameters(args)
    return mapping if experts is None else dataclasses.replace(mapping, expert_parameters=experts)


@functools.lru_cache(maxsize=8)
def _expert_parameters(args: HFModelArgs) -> ExpertParameters | None:
    """The routed experts' parameters as PEFT's `target_parameters` name them (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`), each LoRA adapter of weft's experts in transformers' place one
    adapter of that parameter (scaling x B_e A_e added to expert e's matrix as it is held, which
    PEFT writes transposed where the module uses it as x @ W); None where no adapters can go on
    them (`expert_adapters_refusal`)."""
    if expert_adapters_refusal(args) is not None:
        return None
    model = meta_model(args)
    found = routed_experts(model)
    patterns = {re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", name) for name, _ in found}
    # PEFT lays its factors out by how the module uses the weight: [experts, in, out] (x @ W) where
    # transformers marks it is_transposed (gpt-oss), [experts, out, in] otherwise
    x_at_w = any(getattr(module, "is_transposed", False) for _, module in found)
    return ExpertParameters({f"{p}.{w}": f"{p}.{w}" for p in sorted(patterns)
                             for w in TransformersRoutedExperts.stacked_weights}, x_at_w=x_at_w)
