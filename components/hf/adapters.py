"""A PEFT adapter folder read back onto a weft model, for generation. Writing adapter folders
(and merged ones) is the one Hugging Face writer's, components/hf/writer.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from weft.components.hf.writer import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, ExportError
from weft.models import spec_for_args, spec_for_model
from weft.models.common.hf_names import ExpertParameters
from weft.parallelisms.lora import LoRAOptions, apply_lora, lora_scaling


def load_peft_adapter(model: nn.Module, folder: str | os.PathLike) -> nn.Module:
    """Add the adapters of a PEFT adapter folder (as `save_peft_adapter` writes, or PEFT saves for
    the model's transformers class) to a weft model holding its base weights; for generation.

    A `target_parameters` adapter on a joined expert parameter (gate_up_proj, rank r') is exactly
    one adapter per weft weight: the same A for gate and up, B split between them. weft holds one
    rank and scaling for all adapters, so each is padded with zeros to the largest rank and its B
    scaled by its own scaling over the common one, which leaves what it adds unchanged."""
    folder = Path(folder)
    config, tensors = _read_adapter_folder(folder)
    adapters = _adapter_plan(model, config, tensors, folder)
    rank, alpha, use_rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora"))
    top = max(r for *_, r, _ in adapters.values())
    weft_alpha = alpha * (math.sqrt(top / rank) if use_rslora else top / rank)
    apply_lora(model, LoRAOptions(rank=top, alpha=weft_alpha, use_rslora=use_rslora, target_modules=sorted(adapters)))
    common = lora_scaling(weft_alpha, top, use_rslora)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (a, b, r, scaling) in adapters.items():
            a_name, b_name = _weft_factor_names(name, params)
            padded_a, padded_b = torch.zeros_like(params[a_name]), torch.zeros_like(params[b_name])
            for target, tensor in ((padded_a, a), (padded_b, b * (scaling / common))):
                wanted = list(target.shape)
                wanted[-2 if target is padded_a else -1] = r
                if list(tensor.shape) != wanted:
                    raise ExportError(f"adapter folder {folder}: the adapter of {name} has shape "
                                      f"{list(tensor.shape)}, the model expects {wanted}")
            padded_a[..., :r, :] = a
            padded_b[..., :r] = b * (scaling / common)
            params[a_name].copy_(padded_a)
            params[b_name].copy_(padded_b)
    return model


def _read_adapter_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's adapter_config.json and its tensors (ExportError, one line, otherwise)."""

    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        raise ExportError(f"adapter folder {folder}: cannot read {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ExportError(f"adapter folder {folder}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    return config, tensors


def _adapter_plan(model: nn.Module, config: dict, tensors: dict[str, torch.Tensor],
                  folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, int, float]]:
    """Each weft target's adapter from the folder's tensors: (A, B in weft's layout, rank, scaling).
    A transformers model whose routed experts are adapted gets weft's experts in their place first."""
    spec = spec_for_model(model) or spec_for_args(model.args)  # weft's family, or transformers' backend
    hf = spec.hf_of(model.args)
    rank, alpha, use_rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora"))
    scaling_of = lambda r, a: lora_scaling(a, r, use_rslora)  # noqa: E731
    pairs: dict[str, dict[str, torch.Tensor]] = {}  # PEFT module (and base_layer nesting) -> A, B
    for key, tensor in tensors.items():
        hf_module, _, which = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        pairs.setdefault(hf_module, {})[which.removesuffix(".weight")] = tensor
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor, int, float]] = {}
    experts = _Experts(hf.expert_parameters, config, folder)
    if experts.targeted and spec.prepare_expert_parallel is not None:
        # a transformers model's routed experts take adapters as weft's experts in their place
        # (models/transformers/experts.py), which hold the same names: its loaded weights move over
        weights = model.state_dict()
        spec.prepare_expert_parallel(model)
        model.load_state_dict(weights)
    for hf_module, factors in pairs.items():
        if set(factors) != {"A", "B"}:
            raise ExportError(f"adapter folder {folder}: {hf_module} has lora_{next(iter(factors))} without its pair")
        if experts.holds(hf_module):
            for name, a, b, r in experts.weft_adapters(hf_module, factors["A"], factors["B"]):
                adapters[name] = (a, b, r, experts.scaling(hf_module, scaling_of))
            continue
        try:
            weft_weight = hf.hf_to_weft_name(f"{hf_module}.weight")
        except ValueError:
            raise ExportError(f"adapter folder {folder}: {hf_module}.lora_A names no linear of weft's "
                              f"{type(model).__name__}") from None
        # B makes the output rows: weft's rotary order, as the base weight's
        b = hf.from_hf_tensor(weft_weight, factors["B"], model.args)
        adapters[weft_weight.removesuffix(".weight")] = (factors["A"], b, rank, scaling_of(rank, alpha))
    return adapters


def _weft_factor_names(target: str, params: dict) -> tuple[str, str]:
    """The names of A and B of a weft adapter target: a linear's or a stacked expert weight's."""
    linear = (f"{target}.lora_A.weight", f"{target}.lora_B.weight")
    if linear[0] in params:
        return linear
    experts, w = target.rsplit(".", 1)
    return f"{experts}.lora_A.{w}", f"{experts}.lora_B.{w}"


class _Experts:
    """The `target_parameters` adapters of a PEFT folder, read back as weft's per-weight adapters
    (the layout is written out in components/hf/writer.py's `_PeftExperts`)."""

    def __init__(self, layout: ExpertParameters | None, config: dict, folder: Path):
        self.layout, self.folder = layout, folder
        targets = config.get("target_parameters") or []
        if targets and layout is None:
            raise ExportError(f"adapter folder {folder}: target_parameters {targets}, and the model has no routed experts")
        shorts = [t.rsplit(".", 1)[-1] for t in targets]
        unknown = [t for t, short in zip(targets, shorts) if layout is None or short not in layout.order]
        if unknown:
            raise ExportError(f"adapter folder {folder}: target_parameters names {unknown[0]}, expected the "
                              f"experts' {', '.join(layout.order)}")
        # PEFT nests the wrappers in the order the module defines its parameters: the first one targeted
        # sits under `base_layer.` once per later target.
        self.targeted = sorted(set(shorts), key=lambda short: layout.order.index(short)) if targets else []
        self.rank, self.alpha = int(config["r"]), float(config["lora_alpha"])
        self.rank_pattern, self.alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}

    def holds(self, hf_module: str) -> bool:
        return bool(self.targeted) and (hf_module.endswith(".base_layer") or self._parameter(hf_module) is not None)

    def _parameter(self, hf_module: str) -> str | None:
        """transformers' parameter a PEFT module name (`...experts.base_layer`) adapts, None if none."""
        nested = 0
        while hf_module.endswith(".base_layer"):
            hf_module, nested = hf_module.removesuffix(".base_layer"), nested + 1
        if nested >= len(self.targeted):
            return None
        parameter = f"{hf_module}.{self.targeted[len(self.targeted) - 1 - nested]}"
        try:
            self.layout.names.to_weft(parameter)
        except ValueError:
            return None
        return parameter

    def scaling(self, hf_module: str, scaling_of) -> float:
        short = self._parameter(hf_module).rsplit(".", 1)[-1]
        return scaling_of(int(self.rank_pattern.get(short, self.rank)), float(self.alpha_pattern.get(short, self.alpha)))

    def weft_adapters(self, hf_module: str, lora_a: torch.Tensor, lora_b: torch.Tensor):
        """(weft weight name, A [E, r', in], B [E, out, r'], r') of each weight joined in the parameter."""
        parameter = self._parameter(hf_module)
        if parameter is None:
            raise ExportError(f"adapter folder {self.folder}: {hf_module} is no expert parameter of target_parameters")
        names = self.layout.joined(self.layout.names.to_weft(parameter))
        d1, experts = lora_b.shape[0], self._experts(parameter, lora_a)
        rank = lora_a.shape[0] // experts
        # lora_A [r'·E, d2]: rows expert-major; lora_B [d1, r'·E]: columns rank-major
        right = lora_a.reshape(experts, rank, -1)  # [E, r', d2]
        left = lora_b.reshape(d1, rank, experts).permute(2, 0, 1)  # [E, d1, r']
        joined_width = (right.shape[2] if self.layout.x_at_w else d1) // len(names)
        for j, name in enumerate(names):
            # each weight's features side by side, or alternating (gpt-oss's interleaved gate and up)
            part = slice(j, None, len(names)) if self.layout.interleaved else slice(j * joined_width, (j + 1) * joined_width)
            if self.layout.x_at_w:  # P[e] = ΔWᵀ side by side: ΔW_j = R[:, part]ᵀ Lᵀ
                yield name, left.transpose(1, 2).contiguous(), right[:, :, part].transpose(1, 2).contiguous(), rank
            else:  # P[e] = ΔW stacked: ΔW_j = L[part] R
                yield name, right.contiguous(), left[:, part, :].contiguous(), rank

    def _experts(self, parameter: str, lora_a: torch.Tensor) -> int:
        short = parameter.rsplit(".", 1)[-1]
        rank = int(self.rank_pattern.get(short, self.rank))
        if lora_a.shape[0] % rank:
            raise ExportError(f"adapter folder {self.folder}: {parameter}'s lora_A has {lora_a.shape[0]} rows, "
                              f"not a multiple of its rank {rank}")
        return lora_a.shape[0] // rank
