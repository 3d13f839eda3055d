"""Reading and writing Hugging Face safetensors folders, one tensor at a time, whatever the model.

A folder holds either one `model.safetensors` or shards `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json` mapping each tensor name to its file. Writing goes into a hidden
sibling folder renamed into place at the end, so a failed write leaves no half-written folder.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weft.components.checkpoint.checkpointer import CheckpointError
from weft.errors import one_line

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConversionError(CheckpointError):
    """A checkpoint or Hugging Face folder that cannot be converted; the message is one line
    naming the path and what is wrong."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; anything else (missing, invalid, not an object) a ConversionError."""
    if not path.is_file():
        raise ConversionError(f"{what} has no {path.name}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{what}: {path.name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{what}: {path.name} holds a {type(value).__name__}, not a JSON object")
    return value


def tensor_files(folder: Path) -> dict[str, Path]:
    """The safetensors file holding each tensor of a Hugging Face folder, by name."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    single = folder / SAFETENSORS
    if single.is_file():
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise ConversionError(f"HF folder {folder} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path)`, with a missing, truncated or garbled file (or tensor) as a ConversionError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConversionError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {one_line(e)})") from None


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group names in order into files of at most max_bytes (a larger tensor gets a file alone)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def write_shards(out: Path, shards: list[list[str]], tensors: Iterator[tuple[str, torch.Tensor]],
                 single_file: str | None = None) -> None:
    """Write `tensors` (name, tensor), in the order of `shards`, as the safetensors files of `out`,
    each file written as soon as its last tensor arrives; the index too if there are several.
    One file is named `single_file` (default model.safetensors)."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, names in enumerate(shards, start=1):
        file = (single_file or SAFETENSORS) if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        shard = {}
        for expected in names:
            name, tensor = next(tensors)
            if name != expected:
                raise ValueError(f"write_shards: got tensor {name!r}, planned {expected!r}")
            shard[name] = tensor.contiguous()
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total_size += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def check_output_folder(out: Path) -> None:
    """Refuse an output folder that is not new or empty, or whose parent cannot hold one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    parent = out.parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                raise ConversionError(f"output folder {out}: {above} is a file, not a folder")
            break


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A hidden sibling of `out` to write into, renamed to `out` if the block succeeds and removed
    either way: a failed write (a corrupt input, a full disk) leaves no `out` folder behind."""
    check_output_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield partial
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename needs the name free
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
