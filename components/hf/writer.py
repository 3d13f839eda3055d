"""The one Hugging Face writer: a full model, a model with its LoRA adapters merged, or a PEFT
adapter folder, written from a stream of (weft name, whole tensor) pairs one tensor at a time.

A source is any function `names -> iterator of (name, tensor)`: a live model in any layout
(`live_source`: shards gathered, pipeline stages broadcast to the writer) or a DCP checkpoint
(export.py). Every rank iterates the stream; the writing rank maps names to Hugging Face's, merges
`W + scaling * B A` (expert by expert for routed experts; in a PEFT folder they are
`target_parameters`, `_PeftExperts`) and writes a file whenever one is full. Model facts come from
the model's spec (models/common/spec.py). Why one writer rank: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from weft.components.checkpoint.state import full_tensors, model_parts, whole_model
from weft.components.hf.model_files import finish_hf_folder
from weft.components.hf.safetensors_io import new_folder, open_safetensors, plan_shards, write_shards
from weft.errors import UserError
from weft.models import spec_for_args
from weft.models.common.spec import HFMapping
from weft.parallelisms.lora import expert_lora_modules, lora_modules, merged_weight

logger = logging.getLogger("weft")

Source = Callable[[list[str]], Iterator[tuple[str, "torch.Tensor | None"]]]
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class ExportError(UserError):
    """An adapter or merged export that cannot be written (no adapters, an existing folder)."""


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters of a model: the weft names of the adapted linears, of the adapted stacked
    expert weights (`layers.1.feed_forward.experts.w1`, see parallelisms/lora.py) and their settings
    (one rank, alpha and scaling for both; dropout is the linears', experts have none)."""

    modules: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    scaling: float
    experts: tuple[str, ...] = ()


def model_adapters(model: nn.Module) -> Adapters | None:
    """The adapters of a model, None without any. Under a pipeline each rank holds some stages'
    adapters: the pipeline ranks exchange theirs, so every rank returns the whole model's."""
    held = [(name, False, m.rank, m.alpha, _dropout(m), m.use_rslora, m.scaling)
            for part in model_parts(model) for name, m in lora_modules(part)]
    held += [(f"{name}.{w}", True, m.lora_rank, m.lora_alpha, None, m.lora_use_rslora, m.lora_scaling)
             for part in model_parts(model) for name, m in expert_lora_modules(part)
             for w, _ in m.lora_A.named_parameters()]
    pp_group = getattr(model, "pp_group", None)
    if pp_group is not None:
        everyone: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(everyone, held, group=pp_group)
        held = [adapter for rank_held in everyone for adapter in rank_held]
    if not held:
        return None
    position = {name: i for i, (name, _) in enumerate(whole_model(model).named_modules())}

    def names(experts: bool) -> tuple[str, ...]:
        chosen = {name for name, is_experts, *_ in held if is_experts == experts}
        return tuple(sorted(chosen, key=lambda name: (position[name.rsplit(".", 1)[0] if experts else name], name)))

    rank, alpha, _, use_rslora, scaling = held[0][2:]
    dropout = next((d for _, is_experts, _, _, d, *_ in held if not is_experts), 0.0)
    return Adapters(names(False), rank, alpha, dropout, use_rslora, scaling, experts=names(True))


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
    in `dtype`, each adapted linear as W + scaling * B A (computed in float32; an adapted stacked
    expert weight likewise, expert by expert, before the Hugging Face layout joins or splits it),
    in files of at most `max_shard_bytes` with an index if several; config.json from `hf_files` (a
    run's recorded files, with its tokenizer) or from `args`. Every rank calls it; rank 0 writes."""
    hf = spec_for_args(args).hf_of(args)
    bases = [n for n in shapes if ".lora_" not in n and not (args.tie_embeddings and n == hf.tied_output)]
    # Each group of weft parameters and the HF tensors it makes (Llama 4: w1 and w3 make one
    # gate_up_proj; Qwen3-MoE: a stacked w1 makes one gate_proj per expert).
    units = hf.units({n: shapes[n] for n in bases})
    left_out = sorted(set(bases) - {n for group, _ in units for n in group})
    if left_out and is_writer():
        logger.info(f"export: left out {len(left_out)} tensors the Hugging Face model has no place for "
                    f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''})")
    adapted = _adapted(adapters)
    order = [x for group, _ in units for n in group for x in ([n, *adapted[n]] if n in adapted else [n])]
    itemsize = torch.empty((), dtype=dtype).element_size()
    carried = hf.carried()  # the source folder's other tensors (a multimodal folder's vision tower), as they are
    files = plan_shards([*((hf_name, sum(shapes[n].numel() for n in group) * itemsize // len(hf_names))
                           for group, hf_names in units for hf_name in hf_names),
                         *((key, _stored_bytes(key, path)) for key, path in carried.items())], max_shard_bytes)

    def tensors():
        stream = source(order)
        for group, hf_names in units:
            parts = []
            for name, tensor in (next(stream) for _ in group):
                if name in adapted:
                    (_, a), (_, b) = next(stream), next(stream)
                    if is_writer():  # stacked experts: [E, out, r] @ [E, r, in], expert by expert
                        tensor = merged_weight(tensor, a, b, adapters.scaling)
                parts.append(tensor)
            yield from zip(hf_names, _to_hf_parts(hf, group, parts, args, dtype, len(hf_names)))
        for key, path in carried.items():  # one at a time, read by the writer only
            yield key, _read_stored(key, path) if is_writer() else None

    def finish(folder: Path) -> None:
        if hf_files is None:
            (folder / "config.json").write_text(json.dumps(hf.hf_config(args, dtype), indent=2) + "\n")
        else:
            finish_hf_folder(hf_files, folder, args, dtype)

    _write(out, files, tensors(), finish)


def write_peft_adapter(out: Path, args, source: Source, adapters: Adapters,
                       base_model_name_or_path: str | None = None) -> None:
    """A PEFT adapter folder (`adapter_model.safetensors` under PEFT's names for the model's
    transformers class, `adapter_config.json`) of `adapters` from `source`: the adapted linears as
    `target_modules`, the adapted routed experts as `target_parameters` (`_PeftExperts`). Every
    rank calls it; rank 0 writes."""
    hf = spec_for_args(args).hf_of(args)
    # A acts on the layer's input (no rotary rows); B makes the layer's output rows, permuted as W's.
    layout_of = {_lora(f"{m}.weight", w): (f"{m}.weight" if w == "B" else _lora(f"{m}.weight", w), _hf_module(hf, m), w)
                 for m in adapters.modules for w in "AB"}
    peft_names = {name: f"{PEFT_PREFIX}{hf_module}.lora_{w}.weight" for name, (_, hf_module, w) in layout_of.items()}
    experts = _PeftExperts(hf, adapters) if adapters.experts else None

    def tensors():
        for name, tensor in source(list(layout_of)):
            yield peft_names[name], _to_hf(hf, [layout_of[name][0]], [tensor], args, None)
        if experts is not None:
            yield from experts.tensors(source)

    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout,
        "use_rslora": adapters.use_rslora, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "target_modules": _target_modules(hf, [_hf_module(hf, m) for m in adapters.modules]),
        "inference_mode": True, "modules_to_save": None,
    }
    if experts is not None:
        config |= experts.config()
        if adapters.dropout and is_writer():
            logger.info(f"export: lora_dropout {adapters.dropout} written as 0 (PEFT refuses dropout with "
                        "target_parameters; dropout does not change what the adapters compute)")

    def finish(folder: Path) -> None:
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    names = list(peft_names.values()) + (experts.names if experts is not None else [])
    _write(out, [names], tensors(), finish, single_file=ADAPTER_WEIGHTS)


class _PeftExperts:
    """Expert adapters in PEFT's `target_parameters` layout (checked with peft 0.21.2).

    PEFT adapts a 3-D parameter P [E, d1, d2] with lora_A [r'·E, d2] (expert-major rows) and lora_B
    [d1, r'·E] (rank-major columns). weft's per-projection adapters of the weights joined in P (gate
    and up in gate_up_proj) become one exact adapter of rank r' = r × (projections joined): block-
    diagonal B and stacked A in F.linear layout, transposed for an x @ W parameter (x_at_w), with
    rank_pattern r' and alpha_pattern alpha·r'/r (rsLoRA: alpha·sqrt(r'/r)) so PEFT's scaling is
    weft's. PEFT wraps one module's targeted parameters in order of definition, each around the
    last, so the first's tensors sit under `base_layer.` once per later target (docs/lora-moe.md).
    """

    def __init__(self, hf: HFMapping, adapters: Adapters):
        self.experts = ep = hf.expert_parameters
        if ep is None or not all(ep.covers(name) for name in adapters.experts):
            raise ExportError(f"the model's Hugging Face mapping has no PEFT layout for the expert adapters "
                              f"({adapters.experts[0]})")
        self.rank, self.alpha, self.use_rslora = adapters.rank, adapters.alpha, adapters.use_rslora
        adapted = set(adapters.experts)
        # Each targeted parameter: the weft weights of every layer that make it, adapted in every layer alike.
        self.parameters: dict[str, list[tuple[str, bool]]] = {}
        slots: dict[str, list[str]] = {}
        for name in adapters.experts:
            self.parameters[ep.parameter(name)] = [(n, n in adapted) for n in ep.joined(name)]
            short = [n.rsplit(".", 1)[-1] for n in ep.joined(name) if n in adapted]
            if slots.setdefault(ep.target(name), short) != short:
                raise ExportError(f"PEFT's target_parameters adapt every layer's {ep.target(name)} alike, but "
                                  f"{name.rsplit('.', 1)[0]} adapts {', '.join(short)} of it and another layer "
                                  f"{', '.join(slots[ep.target(name)])}; adapt the same expert weights in every layer")
        self.targets = sorted(slots, key=lambda target: ep.order.index(target.rsplit(".", 1)[-1]))
        self.ranks = {target: self.rank * len(short) for target, short in slots.items()}
        self.names = [self._peft_name(param, w) for param in self.parameters for w in "AB"]

    def _peft_name(self, parameter: str, which: str) -> str:
        module, short = parameter.rsplit(".", 1)
        later = [t for t in self.targets if self.experts.order.index(t.rsplit(".", 1)[-1]) > self.experts.order.index(short)]
        return f"{PEFT_PREFIX}{module}{'.base_layer' * len(later)}.lora_{which}.weight"

    def config(self) -> dict:
        wider = {target.rsplit(".", 1)[-1]: r for target, r in self.ranks.items() if r != self.rank}
        factor = (lambda r: math.sqrt(r / self.rank)) if self.use_rslora else (lambda r: r / self.rank)
        return {"target_parameters": self.targets, "lora_dropout": 0.0,
                "rank_pattern": wider, "alpha_pattern": {short: self.alpha * factor(r) for short, r in wider.items()}}

    def tensors(self, source: Source) -> Iterator[tuple[str, torch.Tensor | None]]:
        order = [f"{n.rsplit('.', 1)[0]}.lora_{w}.{n.rsplit('.', 1)[1]}" for members in self.parameters.values()
                 for n, adapted in members if adapted for w in "AB"]
        stream = source(order)
        for parameter, members in self.parameters.items():
            pairs = [(next(stream)[1], next(stream)[1]) if adapted else None for _, adapted in members]
            a_name, b_name = self._peft_name(parameter, "A"), self._peft_name(parameter, "B")
            if not is_writer() or any(t is None for pair in pairs if pair is not None for t in pair):
                yield a_name, None
                yield b_name, None
                continue
            lora_a, lora_b = peft_expert_factors([pair and (pair[0].detach().cpu(), pair[1].detach().cpu())
                                                  for pair in pairs], self.experts.x_at_w, self.experts.interleaved)
            yield a_name, lora_a
            yield b_name, lora_b


def peft_expert_factors(pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
                        x_at_w: bool, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (lora_A [r'·E, d2], lora_B [d1, r'·E]) of one transformers expert parameter from weft's
    (A [E, r, in], B [E, out, r]) of each weight joined in it, in order; None for one without an
    adapter, whose output features (as wide as the others', gate_up_proj's halves) stay as they are
    (see `_PeftExperts`). `interleaved`: the joined weights' output features alternate (gpt-oss),
    so the factor holding them is reordered alike."""
    some_a, some_b = next(pair for pair in pairs if pair is not None)
    experts, width, inputs = some_b.shape[0], some_b.shape[1], some_a.shape[2]
    none_a, none_b = some_a.new_zeros(experts, 0, inputs), some_b.new_zeros(experts, width, 0)
    a_s, b_s = zip(*((none_a, none_b) if pair is None else pair for pair in pairs))
    if x_at_w:
        left = torch.cat([a.transpose(1, 2) for a in a_s], dim=2)  # [E, in, r']
        right = _block_diagonal([b.transpose(1, 2) for b in b_s])  # [E, r', out]
    else:
        left = _block_diagonal(list(b_s))  # [E, out, r']
        right = torch.cat(a_s, dim=1)  # [E, r', in]
    if interleaved and len(pairs) > 1:  # output features j of each weight, one after the other: k·n + j -> j·n + k
        if x_at_w:
            right = right.unflatten(2, (len(pairs), -1)).transpose(2, 3).flatten(2)
        else:
            left = left.unflatten(1, (len(pairs), -1)).transpose(1, 2).flatten(1, 2)
    rank, d1 = left.shape[2], left.shape[1]
    return right.reshape(experts * rank, -1).contiguous(), left.permute(1, 2, 0).reshape(d1, rank * experts).contiguous()


def _block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Per expert, the block-diagonal matrix of `blocks` ([E, m_i, n_i] each)."""
    out = blocks[0].new_zeros(blocks[0].shape[0], sum(b.shape[1] for b in blocks), sum(b.shape[2] for b in blocks))
    row = col = 0
    for block in blocks:
        out[:, row:row + block.shape[1], col:col + block.shape[2]] = block
        row, col = row + block.shape[1], col + block.shape[2]
    return out


def _stored_bytes(key: str, path: Path) -> int:
    with open_safetensors(path) as f:
        part = f.get_slice(key)
        return math.prod(part.get_shape()) * _SAFETENSORS_ITEMSIZE[part.get_dtype()]


def _read_stored(key: str, path: Path) -> torch.Tensor:
    with open_safetensors(path) as f:
        return f.get_tensor(key)


_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                         "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _adapted(adapters: Adapters | None) -> dict[str, tuple[str, str]]:
    """Each adapted weight's name -> the names of its A and B (a linear's or a stacked expert weight's)."""
    if adapters is None:
        return {}
    linears = {f"{m}.weight": (_lora(f"{m}.weight", "A"), _lora(f"{m}.weight", "B")) for m in adapters.modules}
    return linears | {n: tuple(f"{n.rsplit('.', 1)[0]}.lora_{w}.{n.rsplit('.', 1)[1]}" for w in "AB")
                      for n in adapters.experts}


def _lora(weight_name: str, which: str) -> str:
    return f"{weight_name.removesuffix('.weight')}.lora_{which}.weight"


def _target_modules(hf: HFMapping, modules: list[str]) -> list[str] | str | None:
    """PEFT's target_modules: the adapted linears' own names, or where the folder holds other towers
    whose linears share those names (a multimodal folder's vision tower), a pattern PEFT matches
    against whole module names, covering the text model's adapted linears in every layer."""
    if not modules:
        return None
    if not hf.carried():
        return sorted({m.rsplit(".", 1)[-1] for m in modules})
    return "|".join(sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules}))


def _hf_module(hf: HFMapping, weft_module: str) -> str:
    return hf.weft_to_peft_name(f"{weft_module}.weight").removesuffix(".weight")


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


def check_peft_export(model: nn.Module) -> None:
    """ExportError, before a run trains, where its adapters could not be written as a PEFT folder
    (expert adapters PEFT cannot hold); works on the meta device."""
    adapters = model_adapters(model)
    if adapters is not None and adapters.experts:
        args = whole_model(model).args
        _PeftExperts(spec_for_args(args).hf_of(args), adapters)


def save_peft_adapter(model: nn.Module, out: str | Path, base_model_name_or_path: str | None = None) -> None:
    """A live weft model's LoRA adapters, in any layout, as a PEFT adapter folder. Every rank calls it."""
    adapters = model_adapters(model)
    if adapters is None:
        raise ExportError("the model has no LoRA adapters to export (apply_lora was not applied)")
    _, source = live_source(model)
    write_peft_adapter(Path(out), whole_model(model).args, source, adapters, base_model_name_or_path)
