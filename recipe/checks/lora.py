"""LoRA's checks against the model: QLoRA's base in NF4, the targets, the PEFT export, NF4 shapes
under FSDP, on a meta-device model before anything is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from weft.components.config import ConfigError, JobConfig
from weft.components.hf.writer import ExportError, check_peft_export
from weft.models import ModelSpec
from weft.parallelisms.common import TransformError
from weft.parallelisms.lora import LoRAOptions, apply_lora, check_nf4_shape, lora_modules
from weft.parallelisms.parallel_dims import ParallelDims
from weft.recipe.checks.experts import prepare_experts
from weft.recipe.config_keys import config_error


def check_lora(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims, lora: LoRAOptions | None) -> None:
    """LoRA (`lora`: its options, None without) against the model `args` of family `spec` (targets,
    NF4 shapes and FSDP shards), on a meta-device model: every refusal before anything is built,
    one line naming the key."""
    peft_folder = cfg.export.peft_folder
    if lora is None:
        if peft_folder:
            raise ConfigError("export.peft_folder: writes LoRA adapters; set lora.enable")
        return
    peft = Path(cfg.job.dump_folder) / peft_folder
    if peft_folder and peft.exists():
        raise ConfigError(f"export.peft_folder: {peft} exists; refusing to overwrite it")
    if cfg.checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint: a LoRA run's adapters start from PEFT's initialisation "
                          "and its base is read from checkpoint.initial_load_path; seed the base in a run without "
                          "lora.enable and give its step-0 as checkpoint.initial_load_path")
    with torch.device("meta"):
        model = spec.build(args)
    prepare_experts(spec, model, lora=lora)
    try:
        apply_lora(model, lora)
        if peft_folder and spec.refusals.peft is not None:
            refusal = spec.refusals.peft(args, [name for name, _ in lora_modules(model)])
            if refusal is not None:
                raise ConfigError(f"export.peft_folder = {peft_folder!r}: {refusal}")
        if peft_folder:
            try:
                check_peft_export(model)
            except ExportError as e:
                raise ConfigError(f"export.peft_folder = {peft_folder!r}: {e}") from None
        shards = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
        for name, module in lora_modules(model) if lora.quantize_base else []:
            check_nf4_shape(name, module.weight.shape, shards)
    except TransformError as e:
        raise config_error(cfg, e) from None
