"""What a run writes after its last step, as [export] asks: a Hugging Face folder of the whole
model (its weights gathered one tensor at a time, with the run's tokenizer and generation
config), or for a LoRA run the PEFT adapter folder and/or the base with the adapters merged."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

from weft.components.config import JobConfig, parse_args
from weft.errors import OneLineParser, UserError, report_user_error
from weft.components.hf import export_at_end
from weft.components.hf.writer import ExportError, save_hf_model, save_peft_adapter
from weft.components.hf.model_files import HF_FILES
from weft.parallelisms.precision import DTYPES
from weft.recipe.plan import RunPlan


def export_after_training(plan: RunPlan, model: nn.Module) -> None:
    """Every rank calls this after the last step; rank 0 writes. Nothing to do without [export] paths."""
    cfg, dump = plan.cfg, Path(plan.cfg.job.dump_folder)
    if cfg.lora.enable and cfg.export.peft_folder:
        save_peft_adapter(model, dump / cfg.export.peft_folder, cfg.checkpoint.initial_load_path or None)
    if cfg.export.hf_folder:  # a LoRA run's adapters merged into the base
        from weft.parallelisms.lora import dequantize_experts
        export_at_end(dequantize_experts(model), dump, cfg.export)  # QLoRA's NF4 experts as the weights they hold


def export_adapter_checkpoint(checkpoint: Path, peft_out: Path | None, merged_out: Path | None,
                              dtype: torch.dtype) -> None:
    """A LoRA run's checkpoint as a PEFT adapter folder and/or a merged Hugging Face folder, in one
    process whatever layout saved it. The run's config.toml (in its dump folder, above the
    checkpoint) says which adapters and which base; the PEFT folder needs only the adapters (the
    base stays on the meta device), the merged one loads the base from the run's
    checkpoint.initial_load_path (QLoRA: quantized as in training) and the run's recorded
    tokenizer and generation config."""
    from weft.components.checkpoint.checkpointer import load_adapter_weights, require_complete_checkpoint
    from weft.parallelisms.lora import dequantize_experts, expert_lora_modules, lora_modules
    from weft.recipe.build import build_model, load_lora_base

    folder = require_complete_checkpoint(checkpoint)
    for out in (peft_out, merged_out):
        if out is not None and out.exists():
            raise ExportError(f"output folder {out} exists; refusing to overwrite it")
    cfg = _run_config(folder)
    plan = RunPlan.from_config(_one_process(cfg, base=merged_out is not None), 1, device_type="cpu",
                               check_environment=False)
    if merged_out is None:  # the adapters alone: the base never leaves the meta device
        model = build_model(plan, None, None)
        for _, module in lora_modules(model) + expert_lora_modules(model):
            module.lora_A.to_empty(device="cpu")
            module.lora_B.to_empty(device="cpu")
    else:
        model = build_model(plan, None, torch.device("cpu"))
        if not cfg.lora.quantize_base:  # QLoRA's base was loaded (and quantized) by build_model
            load_lora_base(plan, model)
    load_adapter_weights(model, folder)
    if peft_out is not None:
        save_peft_adapter(model, peft_out, cfg.checkpoint.initial_load_path or None)
    if merged_out is not None:
        dequantize_experts(model)  # QLoRA's NF4 experts, written as the weights they hold
        recorded = folder.parent.parent / HF_FILES
        save_hf_model(model, merged_out, dtype=dtype,
                      hf_files=recorded if (recorded / "config.json").is_file() else None)


def _run_config(checkpoint: Path) -> JobConfig:
    """The config the run of this checkpoint wrote (<dump_folder>/config.toml), if it trained LoRA."""
    path = checkpoint.parent.parent / "config.toml"
    if not path.is_file():
        raise ExportError(f"--checkpoint: no config.toml of the run at {path} (the dump folder above "
                          f"{checkpoint.parent.name}/{checkpoint.name})")
    cfg = parse_args(["--job.config_file", str(path)])
    if not cfg.lora.enable:
        raise ExportError(f"--checkpoint: {checkpoint} is not a LoRA run's checkpoint ({path} has lora.enable = "
                          "false); export a full model with python -m weft.components.hf export")
    return cfg


def _one_process(cfg: JobConfig, *, base: bool) -> JobConfig:
    """The run's model and adapters in one plain process: no parallelism, compile or pipeline; without
    `base`, no base to load or quantize either."""
    cfg = copy.deepcopy(cfg)
    p = cfg.parallelism
    p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep = 1, 1, 1, 1, 1, 1  # an ep run's experts all in one
    cfg.compile.enable, cfg.activation_checkpoint.mode, cfg.job.simulate_world_size = False, "none", 0
    cfg.export.peft_folder = cfg.export.hf_folder = ""  # the run's own end-of-run exports
    if not base:
        cfg.lora.quantize_base = ""
    return cfg


def main(argv: list[str] | None = None, prog: str = "python -m weft.recipe.export") -> int:
    """`weft export-lora`: a LoRA checkpoint to PEFT and/or merged Hugging Face folders."""
    parser = OneLineParser(prog=prog, description="Export a LoRA run's checkpoint (adapters only) without training.")
    parser.add_argument("--checkpoint", required=True, type=Path, help="DCP step folder, e.g. outputs/run/checkpoint/step-60")
    parser.add_argument("--peft-out", type=Path, help="new PEFT adapter folder (adapter_model.safetensors + adapter_config.json)")
    parser.add_argument("--merged-out", type=Path, help="new Hugging Face folder of the base with the adapters merged")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the merged weights")
    opts = parser.parse_args(argv)
    try:
        if opts.peft_out is None and opts.merged_out is None:
            raise ExportError("give --peft-out, --merged-out or both")
        export_adapter_checkpoint(opts.checkpoint, opts.peft_out, opts.merged_out, DTYPES[opts.dtype])
    except UserError as e:
        return report_user_error(e)
    print(f"exported the adapters of {opts.checkpoint} to " + " and ".join(str(o) for o in (opts.peft_out, opts.merged_out) if o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
