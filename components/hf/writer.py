"""The one Hugging Face writer: a full model, a model with its LoRA adapters merged, or a PEFT
adapter folder, written from a stream of (weft name, whole tensor) pairs one tensor at a time.

A source is any function `names -> iterator of (name, tensor)` that yields the named tensors whole,
in that order: a live model in any layout (`live_source`: DTensor shards gathered with
`full_tensor`, pipeline stages broadcast by the rank holding them, see model_state.full_tensors)
or a DCP checkpoint read one tensor at a time (export.py). Every rank iterates the same stream
(the gathers are collectives); the writing rank maps names and rotary rows to Hugging Face's,
merges `W + scaling * B A` for a LoRA layer as its three tensors arrive, and writes a safetensors
file whenever one is full. So the writer holds one layer's tensors plus one file's buffer; the
other ranks hold what their layout holds.

Pipeline stages are gathered to the writer rather than written by each rank: each tensor lives on
one pipeline rank, one broadcast brings it over, and one rank writing keeps the file plan, the
index and the rename-into-place in one place, the same for every layout.

Every model-specific fact (names, rotary row order, tensors that join several parameters such as
Llama 4's experts' gate_up_proj, config.json) comes from the model's spec (models/spec.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from weft.errors import UserError
from weft.components.hf.model_files import finish_hf_folder
from weft.components.hf.safetensors_io import new_folder, plan_shards, write_shards
from weft.components.model_state import full_tensors, model_parts, whole_model
from weft.models import spec_for_args
from weft.models.spec import HFMapping
from weft.parallelisms.lora import lora_modules

logger = logging.getLogger("weft")

Source = Callable[[list[str]], Iterator[tuple[str, "torch.Tensor | None"]]]
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class ExportError(UserError):
    """An adapter or merged export that cannot be written (no adapters, an existing folder)."""


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters of a model: the weft names of the adapted linears and their settings."""

    modules: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    scaling: float


def model_adapters(model: nn.Module) -> Adapters | None:
    """The adapters of a model, None without any. Under a pipeline each rank holds some stages'
    adapters: the pipeline ranks exchange theirs, so every rank returns the whole model's."""
    held = [(name, m.rank, m.alpha, _dropout(m), m.use_rslora, m.scaling)
            for part in model_parts(model) for name, m in lora_modules(part)]
    pp_group = getattr(model, "pp_group", None)
    if pp_group is not None:
        everyone: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(everyone, held, group=pp_group)
        held = [adapter for rank_held in everyone for adapter in rank_held]
    if not held:
        return None
    position = {name: i for i, (name, _) in enumerate(whole_model(model).named_modules())}
    names = sorted({name for name, *_ in held}, key=lambda name: position[name])
    return Adapters(tuple(names), *held[0][1:])


def _dropout(module: nn.Module) -> float:
    return module.lora_dropout.p if isinstance(module.lora_dropout, nn.Dropout) else 0.0


def live_source(model: nn.Module) -> tuple[dict[str, torch.Size], Source]:
    """The shapes of a live model's tensors (the whole model's under a pipeline) and its source."""
    whole = whole_model(model)
    shapes = {name: t.shape for name, t in get_model_state_dict(whole).items()}
    return shapes, lambda names: full_tensors(model, names)


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def write_model(out: Path, args, shapes: dict[str, torch.Size], source: Source, *, adapters: Adapters | None = None,
                dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 2**30,
                hf_files: Path | None = None) -> None:
    """A Hugging Face model folder of the model `args` from `source`: every base tensor of `shapes`
    in `dtype`, each adapted linear as W + scaling * B A (computed in float32), in files of at most
    `max_shard_bytes` with an index if several; config.json from `hf_files` (a run's recorded
    files, with its tokenizer) or from `args`. Every rank calls it; rank 0 writes."""
    hf = spec_for_args(args).hf
    bases = [n for n in shapes if ".lora_" not in n and not (args.tie_embeddings and n == "output.weight")]
    # Each group of weft parameters and the HF tensors it makes (Llama 4: w1 and w3 make one
    # gate_up_proj; Qwen3-MoE: a stacked w1 makes one gate_proj per expert).
    units = hf.units({n: shapes[n] for n in bases})
    left_out = sorted(set(bases) - {n for group, _ in units for n in group})
    if left_out and is_writer():
        logger.info(f"export: left out {len(left_out)} tensors the Hugging Face model has no place for "
                    f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''})")
    adapted = {f"{m}.weight" for m in (adapters.modules if adapters else ())}
    order = [x for group, _ in units for n in group
             for x in ([n, _lora(n, "A"), _lora(n, "B")] if n in adapted else [n])]
    itemsize = torch.empty((), dtype=dtype).element_size()
    files = plan_shards(((hf_name, sum(shapes[n].numel() for n in group) * itemsize // len(hf_names))
                         for group, hf_names in units for hf_name in hf_names), max_shard_bytes)

    def tensors():
        stream = source(order)
        for group, hf_names in units:
            parts = []
            for name, tensor in (next(stream) for _ in group):
                if name in adapted:
                    (_, a), (_, b) = next(stream), next(stream)
                    if is_writer():
                        tensor = tensor.float() + adapters.scaling * (b.float() @ a.float())
                parts.append(tensor)
            yield from zip(hf_names, _to_hf_parts(hf, group, parts, args, dtype, len(hf_names)))

    def finish(folder: Path) -> None:
        if hf_files is None:
            (folder / "config.json").write_text(json.dumps(hf.hf_config(args, dtype), indent=2) + "\n")
        else:
            finish_hf_folder(hf_files, folder, args, dtype)

    _write(out, files, tensors(), finish)


def write_peft_adapter(out: Path, args, source: Source, adapters: Adapters,
                       base_model_name_or_path: str | None = None) -> None:
    """A PEFT adapter folder (`adapter_model.safetensors` under PEFT's names for the transformers
    Llama, `adapter_config.json`) of `adapters` from `source`. Every rank calls it; rank 0 writes."""
    hf = spec_for_args(args).hf
    # A acts on the layer's input (no rotary rows); B makes the layer's output rows, permuted as W's.
    layout_of = {_lora(f"{m}.weight", w): (f"{m}.weight" if w == "B" else _lora(f"{m}.weight", w), _hf_module(hf, m), w)
                 for m in adapters.modules for w in "AB"}
    peft_names = {name: f"{PEFT_PREFIX}{hf_module}.lora_{w}.weight" for name, (_, hf_module, w) in layout_of.items()}

    def tensors():
        for name, tensor in source(list(layout_of)):
            yield peft_names[name], _to_hf(hf, [layout_of[name][0]], [tensor], args, None)

    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout,
        "use_rslora": adapters.use_rslora, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "target_modules": sorted({_hf_module(hf, m).rsplit(".", 1)[-1] for m in adapters.modules}),
        "inference_mode": True, "modules_to_save": None,
    }

    def finish(folder: Path) -> None:
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    _write(out, [list(peft_names.values())], tensors(), finish, single_file=ADAPTER_WEIGHTS)


def _lora(weight_name: str, which: str) -> str:
    return f"{weight_name.removesuffix('.weight')}.lora_{which}.weight"


def _hf_module(hf: HFMapping, weft_module: str) -> str:
    return hf.weft_to_hf_name(f"{weft_module}.weight").removesuffix(".weight")


def _to_hf_parts(hf: HFMapping, weft_names: list[str], tensors: list, args, dtype: torch.dtype,
                 count: int) -> list[torch.Tensor | None]:
    """The `count` Hugging Face tensors of a unit (`HFMapping.units`), as `_to_hf` makes them (None
    on a rank that does not write)."""
    if not is_writer() or any(t is None for t in tensors):
        return [None] * count
    return [t.to(dtype).contiguous() for t in hf.to_hf_parts(weft_names, [t.detach().to("cpu") for t in tensors], args)]


def _to_hf(hf: HFMapping, weft_names: list[str], tensors: list, args, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The Hugging Face tensor made of these whole weft tensors, on the CPU, laid out as Hugging
    Face's, in `dtype` (None: its own); None on a rank that does not write."""
    if not is_writer() or any(t is None for t in tensors):
        return None
    tensor = hf.to_hf(weft_names, [t.detach().to("cpu") for t in tensors], args)
    return (tensor if dtype is None else tensor.to(dtype)).contiguous()


def _write(out: Path, files: list[list[str]], tensors: Iterator, finish: Callable[[Path], None], *,
           single_file: str | None = None) -> None:
    """Rank 0 writes `tensors` into the planned files of a new `out` (renamed into place when done);
    the other ranks run the same stream for its collectives."""
    out = Path(out)
    if is_writer():
        with new_folder(out) as partial:
            write_shards(partial, files, tensors, single_file=single_file)
            finish(partial)
    else:
        for _ in tensors:
            pass
    if dist.is_initialized():
        dist.barrier()


def save_hf_model(model: nn.Module, out: str | Path, *, dtype: torch.dtype = torch.float32,
                  max_shard_bytes: int = 5 * 2**30, hf_files: Path | None = None) -> None:
    """A live weft model in any layout (pipeline stages included) as a Hugging Face folder, its
    LoRA adapters (if any) merged; see write_model. Every rank calls it."""
    shapes, source = live_source(model)
    write_model(Path(out), whole_model(model).args, shapes, source, adapters=model_adapters(model), dtype=dtype,
                max_shard_bytes=max_shard_bytes, hf_files=hf_files)


def save_peft_adapter(model: nn.Module, out: str | Path, base_model_name_or_path: str | None = None) -> None:
    """A live weft model's LoRA adapters, in any layout, as a PEFT adapter folder. Every rank calls it."""
    adapters = model_adapters(model)
    if adapters is None:
        raise ExportError("the model has no LoRA adapters to export (apply_lora was not applied)")
    _, source = live_source(model)
    write_peft_adapter(Path(out), whole_model(model).args, source, adapters, base_model_name_or_path)
