"""Which model a Hugging Face folder or a weft model is, and its mapping: one `HFMapping` per
model weft implements (Llama: `LlamaForCausalLM`; Llama 4: `Llama4ForCausalLM` and the text part
of `Llama4ForConditionalGeneration`), chosen by config.json's model_type or by the ModelArgs type.

A mapping says, in one interface for every model, how names, tensors and config.json translate;
the facts themselves live with each model (models/<model>/hf_mapping.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weft.models import llama, llama4
from weft.models.llama import hf_mapping as llama_hf
from weft.models.llama4 import hf_mapping as llama4_hf


@dataclass(frozen=True)
class HFMapping:
    model_types: tuple[str, ...]  # config.json model_type values it reads
    args_type: type  # the ModelArgs class of the weft model
    model_class: Callable[[Any], nn.Module]  # ModelArgs -> weft model
    flavors: dict[str, Any]
    hf_config: Callable[[Any, torch.dtype], dict[str, Any]]  # ModelArgs, dtype -> config.json
    args_from_config: Callable[[dict[str, Any]], Any]  # config.json -> ModelArgs (HFConfigError if not)
    architecture: Callable[[dict[str, Any]], dict[str, Any]]  # the config.json fields deciding the function
    hf_name: Callable[[str], str]  # weft parameter name -> HF tensor name
    hf_shape: Callable[[str, torch.Size], list[int]]  # weft name, its shape -> the HF tensor's shape
    to_hf: Callable[[list[str], list[torch.Tensor], Any], torch.Tensor]  # weft names, tensors, args -> HF tensor
    from_hf: Callable[[str, torch.Tensor, Any], torch.Tensor]  # weft name, HF tensor, args -> weft tensor
    prefix: Callable[[dict[str, Any]], str]  # what precedes the model's tensor names in the folder
    # weft names -> {HF tensor name: the weft parameters it is made of, in the order `to_hf` takes them}
    hf_groups: Callable[[Iterable[str]], dict[str, list[str]]]


def _llama4_architecture(config: dict[str, Any]) -> dict[str, Any]:
    fields = dataclasses.asdict(llama4_hf.model_args_from_hf_config(config))
    fields.pop("max_seq_len")  # the rotary table's length, not the function
    return fields


LLAMA = HFMapping(
    model_types=("llama",), args_type=llama.ModelArgs, model_class=llama.Transformer, flavors=llama.LLAMA_FLAVORS,
    hf_config=llama_hf.hf_config, args_from_config=llama_hf.model_args_from_hf_config,
    architecture=llama_hf.architecture_fields, hf_name=llama_hf.weft_to_hf_name,
    hf_shape=lambda name, shape: list(shape),
    to_hf=lambda names, tensors, args: llama_hf.to_hf_tensor(names[0], tensors[0], args),
    from_hf=llama_hf.from_hf_tensor, prefix=lambda config: "",
    hf_groups=lambda names: {llama_hf.weft_to_hf_name(name): [name] for name in names},
)
LLAMA4 = HFMapping(
    model_types=("llama4_text", "llama4"), args_type=llama4.ModelArgs, model_class=llama4.Transformer,
    flavors=llama4.LLAMA4_FLAVORS, hf_config=llama4_hf.hf_config,
    args_from_config=llama4_hf.model_args_from_hf_config, architecture=_llama4_architecture,
    hf_name=llama4_hf.weft_to_hf_name, hf_shape=llama4_hf.hf_shape,
    to_hf=lambda names, tensors, args: llama4_hf.to_hf_tensor(names, tensors),
    from_hf=lambda name, tensor, args: llama4_hf.from_hf_tensor(name, tensor), prefix=llama4_hf.weight_prefix,
    hf_groups=llama4_hf.hf_groups,
)
MAPPINGS = (LLAMA, LLAMA4)
FLAVORS: dict[str, Any] = {name: args for m in MAPPINGS for name, args in m.flavors.items()}


def mapping_for_config(config: dict[str, Any]) -> HFMapping:
    """The mapping of a config.json's model_type (Llama's, whose reader refuses, for any other)."""
    return next((m for m in MAPPINGS if config.get("model_type") in m.model_types), LLAMA)


def mapping_for_args(args: Any) -> HFMapping:
    """The mapping of a weft model's ModelArgs."""
    return next(m for m in MAPPINGS if isinstance(args, m.args_type))
