"""Hugging Face interop: load a Hugging Face folder of any registered family (`LlamaForCausalLM`,
`Llama4ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`) into a weft model of any parallel
layout, and export a DCP checkpoint as such a folder; both move one tensor at a time (a stacked
experts parameter as its per-expert tensors, where the family stores them so), so memory stays
bounded by the largest tensor (plus, on export, the shard being written).

    python -m weft.components.hf export --checkpoint outputs/checkpoint/step-1000 --flavor llama3_8b \\
        --out llama3_8b_hf --dtype bfloat16

Modules: `safetensors_io` (files, shards, index; writing into a folder renamed into place),
`load` (config.json -> ModelArgs, `model_args_for_run`, weights into a model), `writer` (the one
writer: a full model, LoRA merged, or a PEFT adapter folder, from a live model in any layout or a
stream of tensors), `export` (a DCP checkpoint -> a folder; `export.hf_folder` at the end of a run),
`model_files` (config.json, tokenizer and generation_config.json, recorded by a run in
<dump_folder>/hf_files), `cli`. What is a model's own (its name table, the rotary row order,
config.json) lives with the model (`models/<family>/hf_mapping.py`, on `models/common/`); these
modules reach it through the model's spec (`ModelSpec.hf`, models/common/spec.py).
"""

from weft.components.hf.cli import main
from weft.components.hf.export import (
    check_export_folder,
    export_at_end,
    export_to_hf,
    record_hf_files,
)
from weft.components.hf.writer import ExportError, save_hf_model, save_peft_adapter
from weft.components.hf.load import (
    check_same_architecture,
    load_hf_into_model,
    model_args_for_run,
    model_args_from_hf_folder,
    read_hf_config,
)
from weft.components.hf.safetensors_io import ConversionError

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
    "main",
    "model_args_for_run",
    "model_args_from_hf_folder",
    "read_hf_config",
]
