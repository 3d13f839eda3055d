"""weft's grouped experts (models/common/moe.py), which expert parallelism spreads (and tensor
parallelism splits by expert, parallelisms/tp.py), in place of a
transformers family's routed experts where their arithmetic is plain: SwiGLU experts without biases
held as `gate_up_proj` [experts, 2 x hidden, dim] (gate rows first) and `down_proj` [experts, dim,
hidden], as transformers builds DeepSeek V3, GLM-4 MoE, Qwen3-MoE and Mixtral. The new module holds
those two parameters under their names and shapes, so its state (a checkpoint's, an export's) is the
transformers module's in every layout; the family's router, shared expert and the rest stay its own.
"""

from __future__ import annotations

import torch
from torch import nn

from weft.models.common.moe import GroupedExperts, LowRankAdapted, clamped_swiglu, experts_matmul
from weft.models.common.spec import HFConfigError


class TransformersRoutedExperts(nn.Module):
    """Routed experts called as transformers calls them (`hidden_states` [tokens, dim], each token's
    `top_k_index` and `top_k_weights`), holding transformers' `gate_up_proj` and `down_proj` and
    computed by weft's `GroupedExperts.compute` (expert e's w1 is its gate rows of gate_up_proj, w3
    its up rows, w2 its down_proj): each token's outputs weighted by its scores, summed.
    `apply_ep` spreads both weights by expert and exchanges tokens in `grouped` (`stacked_weights`,
    `expert_parallel_method`)."""

    stacked_weights = ("gate_up_proj", "down_proj")
    expert_parallel_method = "grouped"
    compute = staticmethod(GroupedExperts.compute)

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def weights(self, local=lambda t: t) -> list:
        """w1, w2, w3 as `compute` takes them, from `local` (a parallel transform's local shard) of
        each stacked weight; each a `LowRankAdapted` where LoRA gave its weight an adapter
        (`lora_A.gate_up_proj` [experts, rank, dim], `lora_B.gate_up_proj` [experts, 2 x hidden, rank],
        parallelisms/lora.py): gate_up_proj's one adapter, as PEFT holds it, adapts the gate and up
        rows with its A shared and its B's rows cut as the weight's."""
        gate, up = (self._weight("gate_up_proj", local, half) for half in (0, 1))
        return [gate, self._weight("down_proj", local), up]

    def _weight(self, name: str, local, half: int | None = None):
        """The stacked weight `name` (its gate or up half: half 0 or 1), with its adapter if it has one."""
        weight = local(getattr(self, name))
        b = local(getattr(self.lora_B, name)) if hasattr(getattr(self, "lora_B", None), name) else None
        if half is not None:
            weight = weight.chunk(2, dim=1)[half]
            b = None if b is None else b.chunk(2, dim=1)[half]
        return weight if b is None else LowRankAdapted(weight, local(getattr(self.lora_A, name)), b, self.lora_scaling)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [tokens, dim] sorted by expert, counts[e] of them for expert e → [tokens, dim]."""
        return self.compute(x, counts, *self.weights())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        chosen = top_k_index.flatten()
        order = chosen.argsort(stable=True)  # (token, slot) pairs sorted by expert
        source = order // top_k_index.shape[-1]
        counts = torch.bincount(chosen, minlength=self.n_experts)
        routed = self.grouped(hidden_states[source], counts) * top_k_weights.flatten()[order, None].to(hidden_states.dtype)
        return torch.zeros_like(hidden_states, dtype=routed.dtype).index_add(0, source, routed).to(hidden_states.dtype)


class TransformersClampedExperts(TransformersRoutedExperts):
    """gpt-oss's routed experts (`GptOssExperts`) called as transformers calls them, holding its
    `gate_up_proj` [experts, dim, 2 x hidden] (gate and up features alternating) and `down_proj`
    [experts, hidden, dim], both used as x @ W, and their biases: weft's `ClampedSwiGLUExperts`
    arithmetic, gate and up made by one multiply (`experts_matmul` of the weight's transpose, a view).
    An adapter of a weight adds scaling x B_e A_e to it as it is held ([experts, dim, rank] @
    [experts, rank, 2 x hidden]), as PEFT's `target_parameters` do. For LoRA: expert parallelism of
    these experts is refused (models/transformers/spec.py)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, *, alpha: float, limit: float):
        nn.Module.__init__(self)
        self.n_experts, self.alpha, self.limit = n_experts, alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))

    def weights(self, local=lambda t: t) -> list:
        """gate_up_proj and down_proj as `experts_matmul` takes them ([experts, out, in]: their
        transposes), each with its adapter if it has one (B_e A_e added to the weight is A_eᵀ B_eᵀ
        added to its transpose); then their biases."""
        linear = []
        for name in self.stacked_weights:
            weight = local(getattr(self, name)).transpose(1, 2)
            if hasattr(getattr(self, "lora_A", None), name):
                a, b = local(getattr(self.lora_A, name)), local(getattr(self.lora_B, name))
                weight = LowRankAdapted(weight, b.transpose(1, 2), a.transpose(1, 2), self.lora_scaling)
            linear.append(weight)
        return [*linear, local(self.gate_up_proj_bias), local(self.down_proj_bias)]

    def compute(self, x: torch.Tensor, counts: torch.Tensor, gate_up, down, gate_up_bias, down_bias) -> torch.Tensor:
        device = x.device.type
        x = x.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else gate_up.dtype)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        h = experts_matmul(x, counts, gate_up) + gate_up_bias.to(x.dtype)[owner]
        h = clamped_swiglu(h[:, 0::2], h[:, 1::2], self.alpha, self.limit)
        return experts_matmul(h, counts, down) + down_bias.to(x.dtype)[owner]


def clamped_experts(model: nn.Module) -> bool:
    """Whether `model`'s routed experts are gpt-oss's (`TransformersClampedExperts` computes them)."""
    found = routed_experts(model)
    return bool(found) and all(type(module).__name__ == "GptOssExperts" for _, module in found)


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' routed-experts modules of `model` (those holding a 3-D `gate_up_proj`), by name."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.ndim == 3]


def grouped_experts_refusal(model: nn.Module) -> str | None:
    """Why `model`'s routed experts are not plain SwiGLU experts that `TransformersRoutedExperts`
    computes exactly; None where they are (and where it has none)."""
    for name, module in routed_experts(model):
        params = dict(module.named_parameters(recurse=False))
        experts, rows, dim = module.gate_up_proj.shape
        down = params.get("down_proj")
        act = type(getattr(module, "act_fn", None)).__name__
        if set(params) != {"gate_up_proj", "down_proj"}:
            return f"its experts ({name}) hold {', '.join(sorted(set(params) - {'gate_up_proj', 'down_proj'}))} beside gate_up_proj and down_proj"
        if getattr(module, "is_transposed", False) or down is None or list(down.shape) != [experts, dim, rows // 2]:
            return f"its experts ({name}) hold gate_up_proj {list(module.gate_up_proj.shape)} and down_proj " \
                   f"{list(down.shape) if down is not None else None}, not [experts, 2 x hidden, dim] and [experts, dim, hidden]"
        if act not in ("SiLU", "SiLUActivation"):
            return f"its experts ({name}) use {act}, not SiLU"
        if getattr(module, "limit", None) is not None or getattr(module, "alpha", None) is not None:
            return f"its experts ({name}) clamp their activations"
    return None


def swap_in_grouped_experts(model: nn.Module) -> int:
    """Replace each of `model`'s plain routed-experts modules by `TransformersRoutedExperts` of the
    same shape on the same device (meta included), gpt-oss's by `TransformersClampedExperts`;
    HFConfigError where they are neither. Returns how many it replaced."""
    clamped = clamped_experts(model)
    refusal = None if clamped else grouped_experts_refusal(model)
    if refusal is not None:
        raise HFConfigError(refusal)
    found = routed_experts(model)
    for name, module in found:
        parent, _, child = name.rpartition(".")
        with torch.device(module.gate_up_proj.device):
            if clamped:
                experts, dim, columns = module.gate_up_proj.shape
                replacement = TransformersClampedExperts(dim, columns // 2, experts, alpha=module.alpha,
                                                         limit=module.limit)
            else:
                experts, rows, dim = module.gate_up_proj.shape
                replacement = TransformersRoutedExperts(dim, rows // 2, experts)
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    return len(found)
