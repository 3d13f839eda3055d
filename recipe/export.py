"""What a run writes after its last step, as [export] asks, and `weft export`, the same of any
checkpoint weft wrote: a Hugging Face folder of the whole model (its weights one tensor at a
time, with the run's tokenizer and generation config), or for a LoRA or QLoRA run (its
checkpoints hold the adapters only) the base its run recorded with the adapters merged and/or
the PEFT adapter folder."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import torch
from torch import nn

from weft.components.checkpoint.checkpointer import load_adapter_weights, require_complete_checkpoint
from weft.components.config import JobConfig, parse_args
from weft.components.hf import export_at_end
from weft.components.hf.export import export_run_checkpoint, holds_adapters
from weft.components.hf.model_files import HF_FILES
from weft.components.hf.safetensors_io import check_output_folder
from weft.components.hf.writer import ExportError, save_hf_model, save_peft_adapter
from weft.errors import OneLineParser, UserError, report_user_error
from weft.models import flavors
from weft.parallelisms.lora import dequantize_experts, expert_lora_modules, lora_modules
from weft.parallelisms.precision import DTYPES
from weft.recipe.build import build_model, load_lora_base
from weft.recipe.plan import RunPlan


def export_after_training(plan: RunPlan, model: nn.Module) -> None:
    """Every rank calls this after the last step; rank 0 writes. Nothing to do without [export] paths."""
    cfg, dump = plan.cfg, Path(plan.cfg.job.dump_folder)
    if cfg.lora.enable and cfg.export.peft_folder:
        save_peft_adapter(model, dump / cfg.export.peft_folder, cfg.checkpoint.initial_load_path or None)
    if cfg.export.hf_folder:  # a LoRA run's adapters merged into the base
        export_at_end(dequantize_experts(model), dump, cfg.export)  # QLoRA's NF4 experts as the weights they hold


def export_checkpoint(checkpoint: Path, out: Path | None, peft_out: Path | None = None, *, base: Path | None = None,
                      flavor: str | None = None, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> None:
    """`weft export`: any checkpoint weft wrote, in one process whatever layout saved it. A whole
    model's goes to the Hugging Face folder `out` (as `flavor`, by default the model its run
    recorded); a LoRA run's to `out` merged into its base and/or to the PEFT folder `peft_out`
    (see export_adapter_checkpoint). Every output is checked before anything is written, and each
    is renamed into place only when whole."""
    folder = require_complete_checkpoint(checkpoint)
    if out is None and peft_out is None:
        raise ExportError("give --out (alias --merged-out), --peft-out or both")
    outputs = [o for o in (out, peft_out) if o is not None]
    if len(outputs) == 2 and out.resolve() == peft_out.resolve():
        raise ExportError(f"--out and --peft-out: both are {out}; give two folders")
    for o in outputs:
        check_output_folder(o)
    if not holds_adapters(folder):
        for option, value in (("--peft-out", peft_out), ("--base", base)):
            if value is not None:
                raise ExportError(f"{option}: {folder} is not a LoRA run's checkpoint (it holds a whole model); "
                                  "export it with --out alone")
        export_run_checkpoint(folder, out, flavor=flavor, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return
    if flavor is not None:
        raise ExportError(f"--flavor: {folder} holds a LoRA run's adapters; the model is the one its run's "
                          "config.toml names")
    export_adapter_checkpoint(folder, peft_out, out, DTYPES[dtype], base=base, max_shard_bytes=max_shard_bytes)


def export_adapter_checkpoint(checkpoint: Path, peft_out: Path | None, merged_out: Path | None,
                              dtype: torch.dtype, *, base: Path | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """A LoRA run's checkpoint (its `adapter_model`) as a PEFT adapter folder and/or a merged
    Hugging Face folder, with the run's recorded tokenizer and generation config; the PEFT folder
    alone never loads the base."""
    folder = require_complete_checkpoint(checkpoint)
    model, cfg = adapter_model(folder, base=base, with_base=merged_out is not None)
    if merged_out is not None:

        dequantize_experts(model)  # QLoRA's NF4 experts, written as the weights they hold
        recorded = folder.parent.parent / HF_FILES
        save_hf_model(model, merged_out, dtype=dtype, max_shard_bytes=max_shard_bytes,
                      hf_files=recorded if (recorded / "config.json").is_file() else None)
    if peft_out is not None:
        save_peft_adapter(model, peft_out, cfg.checkpoint.initial_load_path or None)


def adapter_model(checkpoint: Path, *, base: Path | None = None, with_base: bool = True) -> tuple[nn.Module, JobConfig]:
    """(the model of a LoRA run's checkpoint on the CPU in one process, whatever layout saved it;
    the run's config). Its config.toml (in its dump folder, above the checkpoint) says which
    adapters and which base; the base is loaded from the run's checkpoint.initial_load_path, or
    from `base` where it has moved (QLoRA: quantized as in training). Without `with_base` the base
    stays on the meta device and only the adapters are real (what a PEFT folder needs)."""

    folder = require_complete_checkpoint(checkpoint)
    cfg = _run_config(folder)
    _point_at_base(cfg, folder.parent.parent / "config.toml", base,
                   needed=with_base or cfg.model.flavor == "from_hf_config")
    plan = RunPlan.from_config(_one_process(cfg, base=with_base), 1, device_type="cpu", check_environment=False)
    if not with_base:  # the adapters alone: the base never leaves the meta device
        model = build_model(plan, None, None)
        for _, module in lora_modules(model) + expert_lora_modules(model):
            module.lora_A.to_empty(device="cpu")
            module.lora_B.to_empty(device="cpu")
    else:
        model = build_model(plan, None, torch.device("cpu"))
        if not cfg.lora.quantize_base:  # QLoRA's base was loaded (and quantized) by build_model
            load_lora_base(plan, model)
    load_adapter_weights(model, folder)
    return model, cfg


def _run_config(checkpoint: Path) -> JobConfig:
    """The config the LoRA run of this adapter checkpoint wrote (<dump_folder>/config.toml)."""
    path = checkpoint.parent.parent / "config.toml"
    if not path.is_file():
        raise ExportError(f"--checkpoint: {checkpoint} holds LoRA adapters only, and there is no config.toml of "
                          f"its run at {path} (the dump folder above {checkpoint.parent.name}/{checkpoint.name}) "
                          "to say which base and adapters")
    cfg = parse_args(["--job.config_file", str(path)])
    if not cfg.lora.enable:
        raise ExportError(f"--checkpoint: {checkpoint} holds LoRA adapters, but {path} has lora.enable = false")
    return cfg


def _point_at_base(cfg: JobConfig, config: Path, base: Path | None, *, needed: bool) -> None:
    """Point `cfg` at the run's base where the export reads it: `base`, in place of the recorded
    checkpoint.initial_load_path; without `base`, that path, which must still hold it when `needed`."""
    recorded = cfg.checkpoint.initial_load_path
    if base is not None:
        if not recorded:
            raise ExportError(f"--base: the run of {config} trained on the seeded initialisation "
                              "(checkpoint.initial_load_path = ''), not on a base folder")
        if not base.is_dir():
            raise ExportError(f"--base: no folder at {base}")
        cfg.checkpoint.initial_load_path = str(base)
    elif needed and recorded and not Path(recorded).exists():
        raise ExportError(f"checkpoint.initial_load_path = '{recorded}' in {config}: the run's base is not there "
                          "(moved or removed); `weft export --base` reads it from where it is now")


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
    """`weft export` (and its alias `weft export-lora`): a checkpoint to Hugging Face and PEFT folders."""
    parser = OneLineParser(prog=prog, description=(
        "Export a checkpoint weft wrote: a whole model's to a Hugging Face folder; a LoRA or QLoRA run's "
        "(adapters only) merged into the base its run recorded and/or as a PEFT adapter folder."
        + (" `weft export-lora` is an alias of `weft export`." if prog.endswith("export-lora") else "")))
    parser.add_argument("--checkpoint", required=True, type=Path, help="DCP step folder, e.g. outputs/run/checkpoint/step-60")
    parser.add_argument("--out", "--merged-out", dest="out", type=Path,
                        help="new (or empty) Hugging Face folder: the model, a LoRA run's adapters merged into its base")
    parser.add_argument("--peft-out", type=Path,
                        help="new (or empty) PEFT adapter folder of a LoRA run's checkpoint "
                             "(adapter_model.safetensors + adapter_config.json)")
    parser.add_argument("--base", type=Path, help="a LoRA run's base where it is now, if it moved from the run's "
                                                  "checkpoint.initial_load_path (a Hugging Face folder or a DCP step folder)")
    parser.add_argument("--flavor", choices=list(flavors()),
                        help="model flavor of a whole model's checkpoint (default: what its run recorded in "
                             "<dump_folder>/hf_files); a LoRA run's is in its config.toml")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the written weights")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    opts = parser.parse_args(argv)
    if not (math.isfinite(opts.max_shard_gb) and opts.max_shard_gb > 0):
        parser.error(f"--max-shard-gb: expected a positive number, got {opts.max_shard_gb}")
    try:
        export_checkpoint(opts.checkpoint, opts.out, opts.peft_out, base=opts.base, flavor=opts.flavor,
                          dtype=opts.dtype, max_shard_bytes=int(opts.max_shard_gb * 2**30))
    except UserError as e:
        return report_user_error(e)
    print(f"exported {opts.checkpoint} to " + " and ".join(str(o) for o in (opts.out, opts.peft_out) if o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
