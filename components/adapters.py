"""LoRA adapters out to the ecosystem: a PEFT adapter folder, or a merged Hugging Face folder.

`save_peft_adapter` writes `adapter_model.safetensors` + `adapter_config.json` that
`peft.PeftModel.from_pretrained` loads onto the transformers model; `save_merged_hf` writes the
model with each adapter folded into its base (W + scaling * B A) as a plain Hugging Face folder.
Both take the trained model in any layout (every rank calls them: split tensors are gathered)
and write from rank 0 only, into a temporary folder renamed into place, so a failure leaves no
`out` folder. weft's Llama is written under Hugging Face's names and rotary row order; a
transformers model keeps its own names.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from weft.components.errors import UserError
from weft.components.hf.model_files import HF_FILES, finish_hf_folder
from weft.models import spec_for_model
from weft.parallelisms.lora import LoRALinear, apply_lora, lora_modules

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class ExportError(UserError):
    """An adapter or merged export that cannot be written (no adapters, an existing folder)."""


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: gathered if split (a collective), dequantized if NF4."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if hasattr(t, "get_original_weight"):  # torchao's NF4Tensor
        t = t.get_original_weight()
    return t.detach().cpu()


def _hf_name(model: nn.Module, name: str) -> str:
    """A parameter's name in the Hugging Face model (a weft model's mapped, transformers' as is)."""
    spec = spec_for_model(model)
    return spec.hf.weft_to_hf_name(name) if spec is not None else name


def _hf_values(model: nn.Module, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Values laid out as in the Hugging Face model (weft's wq/wk rows in rotate_half order)."""
    spec = spec_for_model(model)
    return spec.hf.to_hf_tensor(name, weight, model.args) if spec is not None else weight


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's whole A and B under PEFT's names (`base_model.model.<hf module>.lora_A.weight`)."""
    state = {}
    for name, module in lora_modules(model):
        hf_module = _hf_name(model, f"{name}.weight").removesuffix(".weight")
        # A acts on the layer's input (no rotary permutation); B makes its output rows, permuted as W's.
        state[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = full_tensor(module.lora_A.weight)
        state[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = _hf_values(model, f"{name}.weight",
                                                                      full_tensor(module.lora_B.weight))
    return state


def adapter_config(model: nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """PEFT's LoraConfig for the model's adapters (one rank, alpha, dropout for all of them)."""
    modules = lora_modules(model)
    if not modules:
        raise ExportError("the model has no LoRA adapters to export (apply_lora was not applied)")
    first = modules[0][1]
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    targets = sorted({_hf_name(model, f"{n}.weight").removesuffix(".weight").rsplit(".", 1)[-1] for n, _ in modules})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank, "lora_alpha": first.alpha, "lora_dropout": dropout, "use_rslora": first.use_rslora,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }


def merged_state(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The whole model under Hugging Face names, each LoRA layer as W + scaling * B A."""
    loras = dict(lora_modules(model))
    state = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            continue
        weight = full_tensor(param)
        if module_name in loras and leaf == "weight":
            lora: LoRALinear = loras[module_name]
            a, b = full_tensor(lora.lora_A.weight).float(), full_tensor(lora.lora_B.weight).float()
            weight = weight.float() + lora.scaling * (b @ a)
        if spec_for_model(model) is not None and name == "output.weight" and model.args.tie_embeddings:
            continue
        state[_hf_name(model, name)] = _hf_values(model, name, weight).to(dtype).contiguous()
    return state


def save_peft_adapter(model: nn.Module, out: str | os.PathLike, base_model_name_or_path: str | None = None) -> None:
    """Write the PEFT adapter folder `out` (all ranks call; rank 0 writes)."""
    config = adapter_config(model, base_model_name_or_path)
    _write_folder(out, adapter_state(model), ADAPTER_WEIGHTS, {ADAPTER_CONFIG: config})


def save_merged_hf(model: nn.Module, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   hf_files: Path | None = None) -> None:
    """Write weft's Llama with its adapters merged as a Hugging Face folder (all ranks call; rank 0
    writes). hf_files: the files a run recorded (its tokenizer, generation_config.json and the
    base's config.json, components/hf/model_files.py), written beside the weights as a full
    export writes them; without, config.json alone."""
    spec = spec_for_model(model)
    if spec is None:
        raise ExportError(f"a merged export needs weft's Llama, got {type(model).__name__}")
    if not lora_modules(model):
        raise ExportError("the model has no LoRA adapters to merge (apply_lora was not applied)")
    finish = (lambda folder: finish_hf_folder(hf_files, folder, model.args, dtype)) if hf_files else None
    _write_folder(out, merged_state(model, dtype), "model.safetensors", {"config.json": spec.hf.hf_config(model.args, dtype)},
                  finish)


def _write_folder(out: str | os.PathLike, tensors: dict[str, torch.Tensor], weights_file: str,
                  configs: dict[str, dict], finish: Callable[[Path], None] | None = None) -> None:
    out = Path(out)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if out.exists():
        raise ExportError(f"output folder {out} exists; refusing to overwrite it")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(tensors, str(staging / weights_file), metadata={"format": "pt"})
        for file, config in configs.items():
            (staging / file).write_text(json.dumps(config, indent=2) + "\n")
        if finish is not None:
            finish(staging)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_lora_at_end(model: nn.Module, dump_folder: Path, peft_folder: str, hf_folder: str,
                       dtype: torch.dtype, base_model_name_or_path: str | None = None) -> None:
    """[export] of a LoRA run after its last step: the PEFT adapter folder and/or the merged
    Hugging Face folder with the run's tokenizer and generation config (paths relative to the dump
    folder; every rank calls, rank 0 writes)."""
    if peft_folder:
        save_peft_adapter(model, dump_folder / peft_folder, base_model_name_or_path)
    if hf_folder:
        recorded = dump_folder / HF_FILES
        save_merged_hf(model, dump_folder / hf_folder, dtype, recorded if (recorded / "config.json").is_file() else None)


def load_peft_adapter(model: nn.Module, folder: str | os.PathLike) -> nn.Module:
    """Add the adapters of a PEFT adapter folder (as `save_peft_adapter` writes, or PEFT saves for
    the transformers Llama) to weft's Llama, which holds its base weights; for generation."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        raise ExportError(f"adapter folder {folder}: cannot read {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ExportError(f"adapter folder {folder}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    hf = spec_for_model(model).hf
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
