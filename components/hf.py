"""Hugging Face Llama interop: export a DCP checkpoint to a `LlamaForCausalLM` folder, and load
such a folder into a weft model of any parallel layout.

    python -m components.hf export --checkpoint outputs/checkpoint/step-1000 --flavor llama3_8b \\
        --out llama3_8b_hf --dtype bfloat16

Two things differ between the formats besides the names:

- rotary pairs: weft (like Meta's reference code) rotates adjacent channels (x[2i], x[2i+1]) of
  each head; Hugging Face's `rotate_half` rotates channel i with channel i + head_dim/2. The
  attention scores agree when the rows of wq and wk are reordered within each head, evens
  first then odds (`permute_for_hf`), and back on import (`unpermute_from_hf`);
- tied embeddings: Hugging Face stores no `lm_head.weight` when `tie_word_embeddings` is set.

Both directions move one tensor at a time, so memory stays bounded by the largest tensor (plus,
on export, the shard being written) whatever the model size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import math
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor.experimental import implicit_replication

from components.checkpoint import (
    CheckpointError,
    dcp_call,
    listing,
    model_tensor_metadata,
    require_complete_checkpoint,
)
from components.errors import EXIT_USER_ERROR, PREFIX, UserError, one_line, report_user_error
from models.llama import LLAMA_FLAVORS, ModelArgs, RopeScaling, Transformer

__all__ = [
    "ConversionError",
    "export_to_hf",
    "from_hf_tensor",
    "hf_config",
    "hf_to_weft_name",
    "load_hf_into_model",
    "model_args_from_hf_config",
    "permute_for_hf",
    "read_hf_config",
    "to_hf_tensor",
    "unpermute_from_hf",
    "weft_to_hf_name",
]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConversionError(CheckpointError):
    """A checkpoint or Hugging Face folder that cannot be converted; the message is one line
    naming the path and what is wrong."""


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_BACK = {hf: weft for weft, hf in _TOP_LEVEL.items()}
_IN_BLOCK_BACK = {hf: weft for weft, hf in _IN_BLOCK.items()}
_WEFT_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def weft_to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` → `model.layers.3.self_attn.q_proj.weight`."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _WEFT_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK:
        return f"model.layers.{match.group(1)}.{_IN_BLOCK[match.group(2)]}"
    raise ValueError(f"no Hugging Face name for weft parameter {name!r}")


def hf_to_weft_name(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `layers.3.attention.wq.weight`."""
    if name in _TOP_LEVEL_BACK:
        return _TOP_LEVEL_BACK[name]
    match = _HF_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK_BACK:
        return f"layers.{match.group(1)}.{_IN_BLOCK_BACK[match.group(2)]}"
    raise ValueError(f"no weft name for Hugging Face tensor {name!r}")


# ---------------------------------------------------------------------------------------------
# Tensors: the rotary row order of wq and wk
# ---------------------------------------------------------------------------------------------


def permute_for_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a weft wq/wk ([n_heads·head_dim, dim]) for `rotate_half`.

    Within each head, weft row 2i + c (pair i, c = 0 or 1) becomes row c·head_dim/2 + i: the
    even rows first, then the odd ones, so that HF's pair (i, i + head_dim/2) is weft's pair
    (2i, 2i + 1), rotated by the same frequency.
    """
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def unpermute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_hf`: HF q_proj/k_proj rows back to weft's adjacent-pair order."""
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _rotary_heads(weft_name: str, args: ModelArgs) -> int | None:
    """Heads to permute over for wq (query heads) and wk (key/value heads); None otherwise."""
    if weft_name.endswith("attention.wq.weight"):
        return args.n_heads
    if weft_name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def to_hf_tensor(weft_name: str, weight: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """A weft parameter's values laid out as its Hugging Face counterpart."""
    heads = _rotary_heads(weft_name, args)
    return weight if heads is None else permute_for_hf(weight, heads)


def from_hf_tensor(weft_name: str, weight: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """A Hugging Face tensor's values laid out as the weft parameter `weft_name`."""
    heads = _rotary_heads(weft_name, args)
    return weight if heads is None else unpermute_from_hf(weight, heads)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with the shape and rotary settings of `args`."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    return config


def _required(config: dict[str, Any], key: str, source: str) -> Any:
    if key not in config:
        raise ConversionError(f"{source}: config.json has no {key}")
    return config[key]


def _architecture(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields of a Llama config.json that decide the model's function, with HF's defaults
    filled in and both rotary formats (`rope_scaling` + `rope_theta`, or `rope_parameters`) read."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConversionError(f"{source} is a {model_type} model, not llama")
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise ConversionError(f"{source} holds a {architectures[0]}, not a LlamaForCausalLM")
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, supported) != supported:
            raise ConversionError(f"{source}: {key} is {config[key]}; weft's Llama supports only {supported}")

    hidden = _required(config, "hidden_size", source)
    heads = _required(config, "num_attention_heads", source)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
    else:
        raise ConversionError(f"{source}: rope_type {rope_type} is not supported (default or llama3)")
    return {
        "hidden_size": hidden,
        "intermediate_size": _required(config, "intermediate_size", source),
        "num_hidden_layers": _required(config, "num_hidden_layers", source),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "vocab_size": _required(config, "vocab_size", source),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "rope_scaling": scaling,
    }


def model_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """The ModelArgs of a Hugging Face Llama `config.json` (as a dict)."""
    a = _architecture(config, "HF config")
    if a["head_dim"] != a["hidden_size"] // a["num_attention_heads"]:
        raise ConversionError(
            f"HF config: head_dim {a['head_dim']} is not hidden_size / num_attention_heads, which weft requires"
        )
    # ModelArgs rounds the SwiGLU width up to a multiple of `multiple_of`. With multiple_of set to
    # intermediate_size itself, any width in (0, intermediate_size] rounds to exactly it; the
    # multiplier brings the default 8/3·dim width into that range when it is larger.
    intermediate = a["intermediate_size"]
    default_width = int(2 * (4 * a["hidden_size"]) / 3)
    try:
        args = ModelArgs(
            dim=a["hidden_size"],
            n_layers=a["num_hidden_layers"],
            n_heads=a["num_attention_heads"],
            n_kv_heads=a["num_key_value_heads"],
            vocab_size=a["vocab_size"],
            multiple_of=intermediate,
            ffn_dim_multiplier=None if default_width <= intermediate else intermediate / default_width,
            norm_eps=a["rms_norm_eps"],
            rope_theta=a["rope_theta"],
            rope_scaling=a["rope_scaling"],
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=a["tie_word_embeddings"],
        )
    except ValueError as e:  # head counts that do not divide
        raise ConversionError(f"HF config: {e}") from None
    if args.ffn_hidden_dim != intermediate:
        raise ConversionError(f"HF config: intermediate_size {intermediate} cannot be expressed by ModelArgs")
    return args


# ---------------------------------------------------------------------------------------------
# DCP checkpoints
# ---------------------------------------------------------------------------------------------


def _read_dcp_tensor(folder: Path, name: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """The full tensor model.<name>, read alone. DCP assembles it from however it was sharded
    when saved; `no_dist` reads it in this process only, with or without a process group."""
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp_call("load", {f"model.{name}": tensor}, folder, no_dist=True)
    return tensor


def _plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
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
    _check_output_folder(out)
    stored = model_tensor_metadata(folder, args, expected_by)

    # Written into a hidden sibling and renamed into place at the end: a failed export (a
    # corrupt tensor file, a full disk) leaves no half-written or empty --out folder behind.
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_hf_folder(folder, partial, stored, args, dtype, max_shard_bytes)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename needs the name free
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _check_output_folder(out: Path) -> None:
    """Refuse an --out that is not a new or empty folder, or whose parent cannot hold one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output folder {out} exists and is not empty; refusing to overwrite it")
    parent = out.parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                raise ConversionError(f"output folder {out}: {above} is a file, not a folder")
            break
    parent.mkdir(parents=True, exist_ok=True)


def _write_hf_folder(folder: Path, out: Path, stored: dict[str, TensorStorageMetadata], args: ModelArgs,
                     dtype: torch.dtype, max_shard_bytes: int) -> None:
    """The safetensors shards, their index (if several) and config.json, into the existing `out`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(((name, meta.size.numel() * itemsize) for name, meta in stored.items()), max_shard_bytes)
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, names in enumerate(shards, start=1):
        file = SAFETENSORS if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            weight = to_hf_tensor(name, _read_dcp_tensor(folder, name, stored[name]), args)
            tensors[weft_to_hf_name(name)] = weight.to(dtype).contiguous()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a Hugging Face folder, checked to describe a LlamaForCausalLM."""
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConversionError(f"no HF folder at {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"HF folder {folder} has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"HF folder {folder}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"HF folder {folder}: config.json holds a {type(config).__name__}, not a JSON object")
    _architecture(config, f"HF folder {folder}")
    return config


def _tensor_files(folder: Path) -> dict[str, Path]:
    """The safetensors file holding each tensor of a Hugging Face folder, by HF name."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    single = folder / SAFETENSORS
    if single.is_file():
        with _open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise ConversionError(f"HF folder {folder} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")


@contextlib.contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path)`, with a missing, truncated or garbled file (or tensor) as a ConversionError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConversionError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {one_line(e)})") from None


def load_hf_into_model(model: Transformer, hf_dir: str | os.PathLike) -> None:
    """Copy the weights of a Hugging Face Llama folder into `model`, in any parallel layout.

    The folder's config.json must describe a LlamaForCausalLM of the same shape (and rotary,
    norm settings) as `model.args`. The model must already be materialised (after `to_empty`);
    only parameters are written, so the rotary buffers must already be filled (as by
    `init_weights` or by building the model on a real device).

    Each parameter is read whole from its safetensors file, one at a time, un-permuted (wq,
    wk), cast to the parameter's dtype and copied in with `implicit_replication`, so that each
    rank keeps its own slice of a DTensor (FSDP, TP or both). The trade-off: every rank reads
    every full tensor from disk (safetensors maps the file, so ranks of one node share the page
    cache), and memory grows only by the largest tensor, never by the model.
    """
    folder = Path(hf_dir)
    config = read_hf_config(folder)
    theirs = _architecture(config, f"HF folder {folder}")
    ours = _architecture(hf_config(model.args), "the model")
    for field, value in theirs.items():
        if value != ours[field]:
            raise ConversionError(f"HF folder {folder}: {field} is {value}, the model has {ours[field]}")

    files = _tensor_files(folder)
    # a tied output projection appears once, as tok_embeddings; LoRA adapters are not in a base folder
    params = {name: p for name, p in model.named_parameters() if ".lora_" not in name}
    hf_names = {name: weft_to_hf_name(name) for name in params}
    missing = [hf for hf in hf_names.values() if hf not in files]
    if missing:
        raise ConversionError(f"HF folder {folder} lacks tensors {listing(missing)}")
    on_meta = [name for name, p in params.items() if p.device.type == "meta"]
    if on_meta:
        raise ConversionError(f"the model is still on the meta device ({on_meta[0]}): call to_empty first")

    with torch.no_grad(), implicit_replication():
        for name, param in params.items():
            hf_name = hf_names[name]
            with _open_safetensors(files[hf_name]) as f:
                full = f.get_tensor(hf_name)
            if full.shape != param.shape:
                raise ConversionError(
                    f"HF folder {folder}: {hf_name} has shape {list(full.shape)}, the model expects {list(param.shape)}"
                )
            full = from_hf_tensor(name, full, model.args)
            param.copy_(full.to(device=param.device, dtype=param.dtype))


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{PREFIX}{message}\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m components.hf export ...`: export a DCP checkpoint to a Hugging Face folder."""
    parser = _OneLineParser(prog="python -m components.hf", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    export = commands.add_parser("export", help="DCP checkpoint step folder -> Hugging Face LlamaForCausalLM folder")
    export.add_argument("--checkpoint", required=True, help="DCP step folder, e.g. outputs/checkpoint/step-1000")
    export.add_argument("--flavor", required=True, choices=list(LLAMA_FLAVORS), help="model flavor it was trained as")
    export.add_argument("--out", required=True, help="new (or empty) output folder")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    opts = parser.parse_args(argv)
    if not (math.isfinite(opts.max_shard_gb) and opts.max_shard_gb > 0):
        parser.error(f"--max-shard-gb: expected a positive number, got {opts.max_shard_gb}")
    try:
        export_to_hf(
            opts.checkpoint,
            opts.out,
            flavor=opts.flavor,
            dtype={name: dtype for dtype, name in DTYPE_NAMES.items()}[opts.dtype],
            max_shard_bytes=int(opts.max_shard_gb * 2**30),
        )
    except UserError as e:
        return report_user_error(e)
    print(f"exported {opts.checkpoint} ({opts.flavor}, {opts.dtype}) to {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
