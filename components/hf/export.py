"""weft → Hugging Face: a DCP checkpoint written as a `LlamaForCausalLM` folder, one tensor at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from components.checkpoint import dcp_call, model_tensor_metadata, require_complete_checkpoint
from components.hf.safetensors_io import (
    DTYPE_NAMES,
    ConversionError,
    check_output_folder,
    new_folder,
    plan_shards,
    write_shards,
)
from models.llama import LLAMA_FLAVORS, ModelArgs, Transformer
from models.llama.hf_mapping import hf_config, to_hf_tensor, weft_to_hf_name


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
    model_args: ModelArgs | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write the model of a DCP checkpoint as a Hugging Face `LlamaForCausalLM` folder.

    The model's shape comes from `flavor` (a name in LLAMA_FLAVORS) or `model_args`. Runs in
    one process whatever layout saved the checkpoint: each tensor is read whole, one at a time
    (DCP reshards on load), permuted, cast to `dtype` and gathered into safetensors files of at
    most `max_shard_bytes`, which is also about the most memory held at once. One file is
    `model.safetensors`; several are `model-0000k-of-0000n.safetensors` with an index.
    `config.json` is written last. Refuses a missing or unfinished checkpoint, one of another
    shape, and an `out_dir` that exists and is not empty.
    """
    if (flavor is None) == (model_args is None):
        raise ValueError("export_to_hf: give exactly one of flavor and model_args")
    if flavor is not None:
        if flavor not in LLAMA_FLAVORS:
            raise ConversionError(f"unknown flavor {flavor!r}; expected one of {', '.join(LLAMA_FLAVORS)}")
        args, expected_by = LLAMA_FLAVORS[flavor], f"flavor {flavor}"
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
        shapes = Transformer(args)
    stored = model_tensor_metadata(folder, shapes, expected_by)

    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = ((weft_to_hf_name(name), meta.size.numel() * itemsize) for name, meta in stored.items())
    tensors = ((weft_to_hf_name(name), to_hf_tensor(name, _read_dcp_tensor(folder, name, meta), args).to(dtype))
               for name, meta in stored.items())
    with new_folder(out) as partial:
        write_shards(partial, plan_shards(sizes, max_shard_bytes), tensors)
        (partial / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
