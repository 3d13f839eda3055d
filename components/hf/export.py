"""weft → Hugging Face: a DCP checkpoint written as a Hugging Face folder of its family, one tensor at a time."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from weft.components.checkpoint.checkpointer import (
    dcp_call,
    model_tensor_metadata,
    read_dcp_metadata,
    require_complete_checkpoint,
)
from weft.components.config import Export
from weft.components.hf.load import hf_model_args
from weft.components.hf.model_files import HF_FILES, recorded_backend, recorded_source, run_hf_files, write_hf_files
from weft.components.hf.safetensors_io import (
    DTYPE_NAMES,
    ConversionError,
    check_output_folder,
    read_json,
)
from weft.components.hf.writer import save_hf_model, write_model
from weft.models import flavors, spec_for_args

logger = logging.getLogger("weft")


def _read_dcp_tensor(folder: Path, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """The full tensor model.<name>, read alone. DCP assembles it from however it was sharded
    when saved; `no_dist` reads it in this process only, with or without a process group."""
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp_call("load", {f"model.{name}": tensor}, folder, no_dist=True)
    return tensor


def export_to_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    flavor: str | None = None,
    model_args: Any | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    hf_files: Path | None = None,
) -> None:
    """Write the model of a DCP checkpoint as a Hugging Face folder of its family (`LlamaForCausalLM`, ...).

    The model's shape comes from `flavor` (a registered flavor, `weft.models.flavors()`) or `model_args`. Runs in
    one process whatever layout saved the checkpoint: each tensor is read whole, one at a time
    (DCP reshards on load), permuted, cast to `dtype` and gathered into safetensors files of at
    most `max_shard_bytes`, which is also about the most memory held at once. One file is
    `model.safetensors`; several are `model-0000k-of-0000n.safetensors` with an index.
    `config.json` is written last; with `hf_files` (a run's recorded files, see model_files) it is
    that folder's, beside its tokenizer and generation_config.json. Refuses a missing or unfinished checkpoint, one of another
    shape, and an `out_dir` that exists and is not empty.
    """
    if (flavor is None) == (model_args is None):
        raise ValueError("export_to_hf: give exactly one of flavor and model_args")
    if flavor is not None:
        if flavor not in flavors():
            raise ConversionError(f"unknown flavor {flavor!r}; expected one of {', '.join(flavors())}")
        args, expected_by = flavors()[flavor], f"flavor {flavor}"
    else:
        args, expected_by = model_args, "model_args"
    if dtype not in DTYPE_NAMES:
        raise ConversionError(f"dtype {dtype} is not supported; expected one of {', '.join(DTYPE_NAMES.values())}")
    if not max_shard_bytes > 0:
        raise ConversionError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    folder = require_complete_checkpoint(checkpoint_dir)
    out = Path(out_dir)
    check_output_folder(out)
    with torch.device("meta"):
        model = spec_for_args(args).build(args)
    stored = model_tensor_metadata(folder, model, expected_by)
    # and the buffers a folder holds (the transformers backend's: DeepSeek V3's router bias)
    if buffers := spec_for_args(args).backend.folder_buffers(model):
        saved = read_dcp_metadata(folder).state_dict_metadata
        stored |= {name: saved[f"model.{name}"] for name, _ in buffers if f"model.{name}" in saved}

    write_model(out, args, {name: meta.size for name, meta in stored.items()},
                lambda names: ((name, _read_dcp_tensor(folder, name, stored[name])) for name in names),
                dtype=dtype, max_shard_bytes=max_shard_bytes, hf_files=hf_files)


def export_run_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, flavor: str | None = None,
                          dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> None:
    """`export_to_hf` of a run's checkpoint as the model `flavor`, by default the model its run
    recorded (<dump_folder>/hf_files/config.json), written with the run's recorded files."""
    hf_files = run_hf_files(checkpoint_dir)
    if flavor is None and hf_files is None:
        raise ConversionError(f"--flavor: not given, and no {HF_FILES}/config.json recorded by the run above "
                              f"{checkpoint_dir} (a checkpoint of an older weft, or moved); give --flavor")
    # A flavor given wins over the run's record (its shapes are checked against the checkpoint).
    args = None if flavor else hf_model_args(read_json(hf_files / "config.json", str(hf_files)),
                                             str(hf_files / "config.json"), recorded_backend(hf_files),
                                             folder=recorded_source(hf_files))
    export_to_hf(checkpoint_dir, out_dir, flavor=flavor, model_args=args,
                 dtype={name: dtype for dtype, name in DTYPE_NAMES.items()}[dtype],
                 max_shard_bytes=max_shard_bytes, hf_files=hf_files)


def holds_adapters(checkpoint: Path) -> bool:
    """Whether a checkpoint holds a LoRA run's adapters (and so no base) rather than a whole model."""
    return any(key.startswith("model.") and ".lora_" in key for key in read_dcp_metadata(checkpoint).state_dict_metadata)


def _export_folder(dump_folder: Path, hf_folder: str) -> Path:
    return dump_folder / hf_folder  # an absolute hf_folder stays as it is


def check_export_folder(dump_folder: Path, hf_folder: str) -> None:
    """Refuse, before a run starts, an export.hf_folder that is not new or empty."""
    try:
        check_output_folder(_export_folder(dump_folder, hf_folder))
    except ConversionError as e:
        raise ConversionError(f"export.hf_folder: {e}") from None


def record_hf_files(dump_folder: Path, args: Any, tokenizer_path: str, initial_load_path: str) -> None:
    """What an export of this run needs besides weights, in <dump_folder>/hf_files (see model_files)."""
    source = Path(initial_load_path) if initial_load_path else None
    write_hf_files(dump_folder / HF_FILES, args, tokenizer_path,
                   source if source is not None and (source / "config.json").is_file() else None)


def export_at_end(model: torch.nn.Module, dump_folder: Path, export: Export) -> None:
    """[export] after the last step: `save_hf_model` into export.hf_folder with the run's
    recorded files (<dump_folder>/hf_files), in export.dtype."""
    out = _export_folder(dump_folder, export.hf_folder)
    dtype = {name: dtype for dtype, name in DTYPE_NAMES.items()}[export.dtype]
    save_hf_model(model, out, dtype=dtype, max_shard_bytes=int(export.max_shard_gib * 2**30),
                  hf_files=dump_folder / HF_FILES)
    logger.info(f"export: the model as a Hugging Face folder in {out}")
