"""Hugging Face interop: load a folder of any registered family into a weft model of any parallel
layout, and export a DCP checkpoint as such a folder, one tensor at a time (docs/checkpoints.md);
the command is `weft export` (recipe/export.py).

Modules: `safetensors_io` (files, shards, index), `load` (config.json -> ModelArgs, weights into a
model), `writer` (the one writer), `export` (a DCP checkpoint -> a folder), `model_files` (what a
run records). A model's own names and config.json live with the model (`ModelSpec.hf`).
"""

from weft.components.hf.export import (
    check_export_folder,
    export_at_end,
    export_to_hf,
    record_hf_files,
)
from weft.components.hf.load import (
    check_same_architecture,
    load_hf_into_model,
    model_args_for_run,
    model_args_from_hf_folder,
    read_hf_config,
)
from weft.components.hf.safetensors_io import ConversionError
from weft.components.hf.writer import ExportError, save_hf_model, save_peft_adapter

__all__ = [
    "ConversionError",
    "check_export_folder",
    "check_same_architecture",
    "export_at_end",
    "ExportError",
    "save_hf_model",
    "save_peft_adapter",
    "export_to_hf",
    "record_hf_files",
    "load_hf_into_model",
    "model_args_for_run",
    "model_args_from_hf_folder",
    "read_hf_config",
]
