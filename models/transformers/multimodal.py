"""The text model of a multimodal folder (config.json with `text_config`: Gemma 3, Mistral 3, Qwen3.5
as published): its parameters keep the text causal LM's names, read from and written to the folder's
own tensor names. The folder's names are mapped with transformers' code: its load-time renaming of
the multimodal class (`get_model_conversion_mapping`) turns a folder key into the multimodal
model's name, and the module of the multimodal model that is the text model's decoder (same class)
gives the text model's name. The folder's other tensors (vision tower, projector) stay where they are.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from weft.models.common.spec import HFConfigError


def multimodal_class(config: dict) -> type[nn.Module]:
    """The transformers class of a multimodal folder (its `architectures`, as transformers names it)."""
    import transformers

    architecture = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if cls is None:
        raise HFConfigError(f"model_type {config.get('model_type')} is multimodal (config.json has text_config) and "
                            f"its architectures {config.get('architectures')} name no class of transformers "
                            f"{transformers.__version__}")
    return cls


def folder_keys(folder: str) -> dict[str, Path]:
    """Every tensor of a folder's model (its index's, or model.safetensors'), with the file holding it."""

    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return {key: Path(folder) / file for key, file in json.loads(index.read_text())["weight_map"].items()}
    single = Path(folder) / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


class MultimodalNames:
    """`HFNames`' interface (models/common/hf_names.py) for the text model of a multimodal folder:
    each text parameter is the folder's tensor transformers loads into it; `carried`: the
    folder's tensors of the other towers (vision, projector), each with the file holding it."""

    def __init__(self, to_folder: dict[str, str], to_multimodal: dict[str, str], carried: dict[str, Path]):
        self._to_folder, self._to_multimodal, self.carried = to_folder, to_multimodal, carried
        self._to_text = {key: name for name, key in to_folder.items()}

    def to_hf(self, name: str) -> str:
        return self._to_folder.get(name, name)  # one the folder lacks (a tied head) keeps its name

    def to_weft(self, hf_name: str) -> str:
        if hf_name not in self._to_text:
            raise ValueError(f"tensor {hf_name!r} is not the text model's")
        return self._to_text[hf_name]

    def to_peft(self, name: str) -> str:
        """The parameter's name in the multimodal model in memory, as PEFT names its modules."""
        return self._to_multimodal.get(name, name)

    def hf_parts(self, name: str, count: int) -> list[str]:
        return [self.to_hf(name)]

    def stacked(self, name: str) -> bool:
        return False

    def groups(self, weft_names) -> dict[str, list[str]]:
        return {self.to_hf(name): [name] for name in weft_names}

    def to_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor

    def from_hf_tensor(self, name: str, tensor: torch.Tensor, args) -> torch.Tensor:
        return tensor


@functools.lru_cache(maxsize=8)
def multimodal_names(config_json: str, folder: str, decoder_type: type[nn.Module], text_prefix: str,
                     text_names: frozenset[str]) -> MultimodalNames:
    """The folder's names of the text model (its decoder of class `decoder_type` under `text_prefix`,
    its tensors `text_names`) of the multimodal folder `folder` (config.json `config_json`);
    HFConfigError where transformers converts a text tensor on load (not only renames it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    config = json.loads(config_json)
    with torch.device("meta"):
        multimodal = _build_multimodal(config)
    decoders = [path for path, module in multimodal.named_modules() if type(module) is decoder_type]
    if len(decoders) != 1:
        raise HFConfigError(f"{type(multimodal).__name__} holds {len(decoders)} modules of the text model's class "
                            f"{decoder_type.__name__}, not one")
    decoder, base = decoders[0] + ".", multimodal.base_model_prefix + "."
    meta_names = {name for name, _ in multimodal.state_dict(keep_vars=True).items()}
    conversions = get_model_conversion_mapping(multimodal)
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]

    def text_name(multimodal_name: str) -> str | None:
        if multimodal_name.startswith(decoder):
            return f"{text_prefix}.{multimodal_name.removeprefix(decoder)}"
        return None if multimodal_name.startswith(base) else multimodal_name  # the head: lm_head in both

    to_folder, to_multimodal, carried = {}, {}, {}
    for key, path in folder_keys(folder).items():
        multimodal_name, converted = rename_source_key(key, renamings, converters, multimodal.base_model_prefix,
                                                       dict.fromkeys(meta_names, True))
        name = text_name(multimodal_name)
        if name is None or name not in text_names:
            carried[key] = path
            continue
        if converted is not None:
            raise HFConfigError(f"{type(multimodal).__name__}: transformers converts the text tensor {key} on load "
                                f"({converted}), which the transformers backend does not make for a multimodal folder")
        to_folder[name], to_multimodal[name] = key, multimodal_name
    return MultimodalNames(to_folder, to_multimodal, carried)


def _build_multimodal(config: dict) -> nn.Module:
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    return multimodal_class(config)(AutoConfig.for_model(config["model_type"], **fields))
