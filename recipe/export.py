"""What a run writes after its last step, as [export] asks: a Hugging Face folder of the whole
model (its weights gathered one tensor at a time, with the run's tokenizer and generation
config), or for a LoRA run the PEFT adapter folder and/or the base with the adapters merged."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from components.adapters import export_lora_at_end
from components.hf import export_at_end
from parallelisms.precision import DTYPES
from recipe.plan import RunPlan


def export_after_training(plan: RunPlan, model: nn.Module) -> None:
    """Every rank calls this after the last step; rank 0 writes. Nothing to do without [export] paths."""
    cfg, dump = plan.cfg, Path(plan.cfg.job.dump_folder)
    if cfg.lora.enable:
        export_lora_at_end(model, dump, cfg.export.peft_folder, cfg.export.hf_folder, DTYPES[cfg.export.dtype],
                           cfg.checkpoint.initial_load_path or None)
    elif cfg.export.hf_folder:
        export_at_end(model, dump, cfg.export)
