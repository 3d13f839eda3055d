"""Hugging Face folder → weft: its config.json as the ModelArgs of the weft model it describes (the
`ModelSpec` whose HF mapping reads its model_type), its weights into a model of any parallel
layout, one tensor at a time."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication

from weft.components.checkpoint.checkpointer import listing
from weft.components.checkpoint.state import model_parts, whole_model
from weft.components.config import FROM_HF_CONFIG, ConfigError
from weft.components.hf import mxfp4
from weft.components.hf.model_files import recorded_backend, run_hf_files
from weft.components.hf.safetensors_io import ConversionError, open_safetensors, read_json, tensor_files
from weft.models import (
    HFConfigError,
    builds_flavors,
    chosen_backend,
    spec_for_args,
    spec_for_flavor,
    spec_for_hf_config,
)


def folder_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a Hugging Face folder, as JSON."""
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConversionError(f"no HF folder at {folder}")
    return read_json(folder / "config.json", f"HF folder {folder}")


def read_hf_config(hf_dir: str | os.PathLike, backend: str = "weft", trust_remote_code: bool = False) -> dict[str, Any]:
    """The `config.json` of a Hugging Face folder, checked to describe a model `backend` can build
    (`weft.models.spec_for_hf_config`)."""
    config = folder_config(hf_dir)
    hf_model_args(config, f"HF folder {hf_dir}", backend, trust_remote_code=trust_remote_code, folder=hf_dir)
    return config


def hf_model_args(config: dict[str, Any], source: str, backend: str = "weft", *, trust_remote_code: bool = False,
                  folder: str | os.PathLike = "") -> Any:
    """The ModelArgs of a config.json (its spec's `args_from_hf_config`), its refusals as one-line
    ConversionErrors naming `source`. The transformers backend's may run the folder's own code
    (`auto_map`) only with trust_remote_code."""
    spec = spec_for_hf_config(config, backend)
    try:
        return spec.hf.args_from_hf_config(config, trust_remote_code=trust_remote_code, folder=str(folder))
    except HFConfigError as e:
        raise ConversionError(f"{source}: {e}") from None


def model_args_from_hf_folder(hf_dir: str | os.PathLike, backend: str = "weft", trust_remote_code: bool = False) -> Any:
    """The ModelArgs of the model a Hugging Face folder's config.json describes, built by `backend`."""
    return hf_model_args(folder_config(hf_dir), f"HF folder {hf_dir}", backend, trust_remote_code=trust_remote_code,
                         folder=hf_dir)


def check_same_architecture(config: dict[str, Any], args: Any, source: str) -> None:
    """Refuse a config.json whose model differs from `args`, naming the first field that does."""
    spec = spec_for_args(args)
    theirs_spec, hf = spec_for_hf_config(config, spec.backend.name), spec.hf
    try:
        theirs = theirs_spec.hf.architecture_fields(config)
    except HFConfigError as e:
        raise ConversionError(f"{source}: {e}") from None
    if theirs_spec is not spec:
        raise ConversionError(f"{source}: model_type is {config.get('model_type')}, the model is a {spec.name}")
    ours = hf.architecture_fields(hf.hf_config(args, torch.float32))
    for field, value in theirs.items():
        if value != ours[field]:
            raise ConversionError(f"{source}: {field} is {value}, the model has {ours[field]}")


def load_hf_into_model(model: torch.nn.Module, hf_dir: str | os.PathLike, names: Collection[str] | None = None) -> None:
    """Copy the weights of a Hugging Face folder into `model`, in any parallel layout (`names`: only
    these parameters, the others may still be on the meta device). The folder's config.json must
    describe the model of `model.args`; the model must be materialised, its buffers filled (only
    parameters, and the buffers a folder holds, are written). The plan of tensors is checked first
    (`_tensor_plan`), then each is read whole, one at a time, converted to weft's layout, cast and
    copied in with `implicit_replication`, so each rank keeps its slice of a DTensor: memory grows
    by the largest tensor, never by the model. Experts held one tensor per expert (Qwen3-MoE,
    transformers' stacked families) or in MXFP4 are read only for the experts this rank holds.
    """
    plan = _tensor_plan(model, Path(hf_dir), names)
    reader = _FolderReader(plan)
    hf, args = plan.hf, plan.args
    with torch.no_grad(), implicit_replication():
        for name, param in plan.params.items():
            parts = plan.hf_names[name]
            to_weft = functools.partial(hf.from_hf_tensor, name, args=args)
            if hf.stacked(name):
                _load_stacked(param, _expert_readers(reader.read, parts, param.shape), to_weft)
            elif len(parts) > 1:  # tensors joined along the first dimension in equal parts (Kimi Linear's conv1d)
                expected = [param.shape[0] // len(parts), *param.shape[1:]]
                full = to_weft(torch.cat([reader.read(part, expected) for part in parts]))
                param.copy_(full.to(device=param.device, dtype=param.dtype))
            elif parts[0] in plan.packed:
                _load_experts(param, functools.partial(reader.read_packed, parts[0]), hf.shape(name, param.shape),
                              to_weft)
            else:
                full = to_weft(reader.read(parts[0], hf.shape(name, param.shape)))
                param.copy_(full.to(device=param.device, dtype=param.dtype))


@dataclass
class _TensorPlan:
    """What `load_hf_into_model` reads: each parameter (or buffer) and the folder's tensors it is made
    of, the file of each, and which of them are MXFP4 blocks and scales."""

    folder: Path
    args: Any
    hf: Any  # the model's HFMapping
    files: dict[str, Path]  # tensor name -> its safetensors file
    params: dict[str, torch.Tensor]  # weft name -> the parameter or buffer to fill
    hf_names: dict[str, list[str]]  # weft name -> the folder's tensors it is read from
    packed: set[str]  # the tensors held in MXFP4 (gpt-oss as published)


def _tensor_plan(model: torch.nn.Module, folder: Path, names: Collection[str] | None) -> _TensorPlan:
    """The tensors to read into `model` (`names`: only these), checked before any is read: the folder's
    config.json against the model, every tensor present, nothing left on the meta device."""
    args = whole_model(model).args  # a pipeline rank's stages hold the parameters of some of the model
    spec, config = spec_for_args(args), folder_config(folder)
    try:  # a config.json the model's weights cannot come from (weft's families: one their reader refuses)
        spec_for_hf_config(config, spec.backend.name).hf.check_config(config)
    except HFConfigError as e:
        raise ConversionError(f"HF folder {folder}: {e}") from None
    check_same_architecture(config, args, f"HF folder {folder}")

    files = tensor_files(folder)
    # A tied output projection appears once, as tok_embeddings; LoRA adapters are not in a base folder.
    params = {name: p for part in model_parts(model) for name, p in part.named_parameters()
              if ".lora_" not in name and (names is None or name in names)}
    hf = spec.hf_of(args)
    # and the buffers a folder may hold (the transformers backend's: DeepSeek V3's router bias)
    params |= {name: b for part in model_parts(model) for name, b in spec.backend.folder_buffers(part)
               if (names is None or name in names) and hf.prefix(config) + hf.weft_to_hf_name(name) in files}
    hf_names = {name: [hf.prefix(config) + part for part in hf.hf_parts(name, p.shape)] for name, p in params.items()}
    # MXFP4 (gpt-oss as published): a tensor held as its blocks and scales, dequantized when read.
    packed: set[str] = set()
    if mxfp4.quantized(config, f"HF folder {folder}"):
        packed = {part for parts in hf_names.values() for part in parts
                  if part not in files and all(part + suffix in files for suffix in mxfp4.PARTS)}
    missing = [part for parts in hf_names.values() for part in parts if part not in files and part not in packed]
    if missing:
        raise ConversionError(f"HF folder {folder} lacks tensors {listing(missing)}")
    on_meta = [name for name, p in params.items() if p.device.type == "meta"]
    if on_meta:
        raise ConversionError(f"the model is still on the meta device ({on_meta[0]}): call to_empty first")
    return _TensorPlan(folder, args, hf, files, params, hf_names, packed)


class _FolderReader:
    """Reads a plan's tensors from their files, each checked against the shape the model expects; an
    MXFP4 tensor's experts dequantized, kept until every parameter made of it has read it (gate_up_proj:
    w1 and w3)."""

    def __init__(self, plan: _TensorPlan):
        self.folder, self.files = plan.folder, plan.files
        self.readers = Counter(part for parts in plan.hf_names.values() for part in parts if part in plan.packed)
        self.dequantized: dict[tuple[str, int, int], torch.Tensor] = {}

    def read(self, hf_name: str, expected: list[int]) -> torch.Tensor:
        tensor = self.read_one(hf_name)
        if list(tensor.shape) != expected:
            raise ConversionError(f"HF folder {self.folder}: {hf_name} has shape {list(tensor.shape)}, "
                                  f"the model expects {expected}")
        return tensor

    def read_one(self, hf_name: str, rows: slice | None = None) -> torch.Tensor:
        with open_safetensors(self.files[hf_name]) as f:
            return f.get_tensor(hf_name) if rows is None else f.get_slice(hf_name)[rows]

    def read_packed(self, hf_name: str, rows: slice, expected: list[int]) -> torch.Tensor:
        """The experts `rows` of an MXFP4 tensor, dequantized (only those read from disk)."""
        key = (hf_name, rows.start, rows.stop)
        if key not in self.dequantized:
            blocks, scales = (self.read_one(hf_name + suffix, rows) for suffix in mxfp4.PARTS)
            self.dequantized[key] = mxfp4.dequantize(blocks, scales)
        self.readers[hf_name] -= 1
        tensor = self.dequantized[key] if self.readers[hf_name] else self.dequantized.pop(key)
        if list(tensor.shape) != expected:
            raise ConversionError(f"HF folder {self.folder}: {hf_name} (MXFP4) has the experts' shape "
                                  f"{list(tensor.shape)}, the model expects {expected}")
        return tensor


def _expert_readers(read, parts: list[str], shape: torch.Size) -> list:
    """A reader of each expert of a stacked parameter of `shape` from its HF tensors `parts`, expert
    by expert; where an expert has several (transformers' gate_up_proj: its gate's and up's), they
    join along its rows in order."""
    per_expert = len(parts) // shape[0]
    expected = [shape[1] // per_expert, *shape[2:]]

    def reader(chunk: list[str]):
        return lambda: torch.cat([read(part, expected) for part in chunk]) if len(chunk) > 1 else read(chunk[0], expected)

    return [reader(parts[e * per_expert:(e + 1) * per_expert]) for e in range(shape[0])]


def _load_experts(param: torch.Tensor, read_rows, hf_shape: list[int], to_weft) -> None:
    """Fill a stacked experts parameter from one HF tensor of all experts (`read_rows(rows, shape)`
    gives its experts `rows`), reading only the experts this rank holds (a DTensor split along them)."""
    rows = slice(0, param.shape[0])
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        rows = slice(offset[0], offset[0] + shape[0])
    part = to_weft(read_rows(rows, [rows.stop - rows.start, *hf_shape[1:]]))
    if not isinstance(param, DTensor):
        param.copy_(part.to(device=param.device, dtype=param.dtype))
        return
    local = param.to_local()
    if local.numel() == 0:
        return
    for dim in range(1, part.ndim):  # other dimensions split too: this rank's slice
        part = part.narrow(dim, offset[dim], shape[dim])
    local.copy_(part.to(device=local.device, dtype=local.dtype))


def _load_stacked(param: torch.Tensor, experts: list, to_weft) -> None:
    """Fill a stacked experts parameter ([experts, ...]) from its per-expert HF tensors (`experts`:
    a reader for each), reading only the experts this rank holds: under expert parallelism (or
    FSDP) the parameter is a DTensor split along the experts, and its local part is filled from
    those experts' tensors alone."""
    if not isinstance(param, DTensor):
        param.copy_(to_weft(torch.stack([read() for read in experts])).to(device=param.device, dtype=param.dtype))
        return
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if local.numel() == 0:
        return
    stack = to_weft(torch.stack([read() for read in experts[offset[0]:offset[0] + shape[0]]]))
    for dim in range(1, stack.ndim):  # other dimensions split too (tensor parallelism): this rank's slice
        stack = stack.narrow(dim, offset[dim], shape[dim])
    local.copy_(stack.to(device=local.device, dtype=local.dtype))


def model_args_for_run(flavor: str, initial_load_path: str, backend: str = "weft",
                       trust_remote_code: bool = False) -> Any:
    """The model a run trains: the built-in `flavor`, or with flavor `from_hf_config` the model the
    config.json of the Hugging Face folder `initial_load_path` describes (of a DCP step folder, the
    one its run recorded, by that run's backend unless `backend` says otherwise), built by `backend`
    (model.backend: "auto", "weft" or "transformers", see `weft.models.spec_for_hf_config`). A
    built-in flavor given with a Hugging Face `initial_load_path` must describe the same model:
    refused otherwise, in one line naming the first field that differs. Reads config.json only, so
    it plans without weights."""
    folder = Path(initial_load_path) if initial_load_path else None
    is_hf = folder is not None and (folder / "config.json").is_file()
    try:
        if flavor == FROM_HF_CONFIG:
            recorded = run_hf_files(folder) if folder is not None and not is_hf else None
            if recorded is not None:  # a DCP step of an earlier run: the model that run recorded, by its backend
                return model_args_from_hf_folder(recorded, chosen_backend(backend, recorded_backend(recorded)),
                                                 trust_remote_code)
            if not is_hf:
                raise ConfigError(f"model.flavor = {FROM_HF_CONFIG}: checkpoint.initial_load_path must be a Hugging "
                                  f"Face folder holding config.json or a checkpoint step of a weft run, got "
                                  f"{initial_load_path!r}")
            return model_args_from_hf_folder(folder, backend, trust_remote_code)
        if not builds_flavors(backend):
            raise ConfigError(f"model.backend = transformers builds the model of a Hugging Face folder; set "
                              f"model.flavor = {FROM_HF_CONFIG}, not {flavor}")
        args = spec_for_flavor(flavor).flavors[flavor]
        if is_hf:
            check_same_architecture(read_hf_config(folder), args, f"HF folder {folder}")
        return args
    except ConversionError as e:
        hint = f" (model.flavor = {FROM_HF_CONFIG} takes the folder's)" if flavor != FROM_HF_CONFIG else ""
        raise ConversionError(f"checkpoint.initial_load_path: {e}{hint}") from None
