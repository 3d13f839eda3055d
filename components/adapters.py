"""A PEFT adapter folder read back onto weft's Llama, for generation. Writing adapter folders
(and merged ones) is the one Hugging Face writer's, components/hf/writer.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from weft.components.hf.writer import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, ExportError
from torch import nn

from weft.models import spec_for_model
from weft.parallelisms.lora import apply_lora


def load_peft_adapter(model: nn.Module, folder: str | os.PathLike) -> nn.Module:
    """Add the adapters of a PEFT adapter folder (as `save_peft_adapter` writes, or PEFT saves for
    the transformers Llama) to weft's Llama, which holds its base weights; for generation."""
    hf = spec_for_model(model).hf
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        raise ExportError(f"adapter folder {folder}: cannot read {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ExportError(f"adapter folder {folder}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    values = {}
    for key, tensor in tensors.items():
        hf_module, _, which = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        try:
            weft_weight = hf.hf_to_weft_name(f"{hf_module}.weight")
        except ValueError:
            raise ExportError(f"adapter folder {folder}: {key} names no linear of weft's Llama") from None
        values[(weft_weight.removesuffix(".weight"), which.removesuffix(".weight"))] = (weft_weight, tensor)
    apply_lora(model, rank=config["r"], alpha=float(config["lora_alpha"]), use_rslora=bool(config.get("use_rslora")),
               target_modules=sorted({name for name, _ in values}))
    with torch.no_grad():
        for (name, which), (weft_weight, tensor) in values.items():
            param = model.get_submodule(f"{name}.lora_{which}").weight
            if which == "B":  # output rows in weft's rotary order, as the base weight's
                tensor = hf.from_hf_tensor(weft_weight, tensor, model.args)
            if tensor.shape != param.shape:
                raise ExportError(f"adapter folder {folder}: {name}.lora_{which} has shape {list(tensor.shape)}, "
                                  f"the model expects {list(param.shape)}")
            param.copy_(tensor)
    return model
