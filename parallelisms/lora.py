"""Low-rank adapters (LoRA) and their NF4-quantized base (QLoRA) as a transform.

`apply_lora` turns each targeted `nn.Linear` into a `LoRALinear` (still an `nn.Linear`, its frozen
`weight` and `bias` keeping their names) with trainable `lora_A` and `lora_B`:

    y = x W^T + b + scaling * B(A(dropout(x))),   scaling = alpha / rank  (rslora: alpha / sqrt(rank))

Targeted routed experts get one adapter per expert; A starts as PEFT's, B at zero.
`quantize_lora_base` stores the frozen weights as NF4. Layouts: docs/lora.md, docs/lora-moe.md.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from weft.errors import TransformError, refuse_data_parallel_model
from weft.layers import EXPERT_WEIGHTS, ROUTER
from weft.layers.init import param_seed
from weft.layers.nf4_experts import NF4Experts, torchao_nf4
from weft.parallelisms.plans import path_matches

logger = logging.getLogger("weft")

QUANTIZE_BASE_CHOICES = ("nf4",)
EXPERTS = "experts"  # the target name of every routed expert's projections
# torchao's NF4: one absmax scale per NF4_BLOCK values, and those scales quantized in groups of at
# most NF4_SCALER_BLOCK blocks (nf4_scaler_block picks the group per weight size).
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_MIN_SCALER_BLOCK, NF4_GROUPS_MULTIPLE = 32, 8
# Output heads stay whole when no target_modules are given (PEFT's "all-linear" does the same), and
# so do Mixture-of-Experts routers: an adapter there would move the routing.
OUTPUT_HEADS = ("output", "lm_head")


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """What an adapter's output is multiplied by: alpha / rank (rsLoRA: alpha / sqrt(rank))."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nn.Linear):
    """An nn.Linear with a frozen base (`weight`, `bias`) plus trainable `lora_A`, `lora_B`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 use_rslora: bool = False, quantize_base: str | None = None):
        with torch.device("meta"):  # the base's own tensors are moved in below, nothing allocated
            super().__init__(base.in_features, base.out_features, bias=False)
        self.weight = base.weight
        self.bias = base.bias
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(alpha, rank, use_rslora)
        self.quantize_base = quantize_base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.rank}, scaling={self.scaling:g}" + (
            f", base={self.quantize_base}" if self.quantize_base else "")


class ExpertAdapters(nn.Module):
    """One factor of the adapters of a stack of routed experts: a parameter per adapted projection
    (`w1`, `w2`, `w3`), stacked by expert (lora_A: [experts, rank, in]; lora_B: [experts, out, rank])."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], *, device: torch.device, dtype: torch.dtype):
        super().__init__()
        for w, shape in shapes.items():
            self.register_parameter(w, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))


def add_expert_adapters(experts: nn.Module, projections: list[str], rank: int, alpha: float,
                        use_rslora: bool) -> None:
    """Give the stacked `experts` (GroupedExperts) a rank-`rank` adapter per expert on each of
    `projections` (the layout of the module doc), A and B in the experts' dtype."""
    weights = {w: getattr(experts, w) for w in projections}
    factory = dict(device=weights[projections[0]].device, dtype=weights[projections[0]].dtype)
    experts.lora_A = ExpertAdapters({w: (p.shape[0], rank, p.shape[2]) for w, p in weights.items()}, **factory)
    experts.lora_B = ExpertAdapters({w: (p.shape[0], p.shape[1], rank) for w, p in weights.items()}, **factory)
    experts.lora_rank, experts.lora_alpha, experts.lora_use_rslora = rank, alpha, use_rslora
    experts.lora_scaling = lora_scaling(alpha, rank, use_rslora)


@dataclass(frozen=True)
class LoRAOptions:
    """`apply_lora`'s options."""

    rank: int = 8  # each adapter's inner dimension (B A)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (rslora: alpha / sqrt(rank))
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] | tuple[str, ...] | None = None  # last names or globs; None: all but heads, routers
    use_rslora: bool = False  # scale by alpha / sqrt(rank)
    quantize_base: str | None = None  # "nf4": the frozen base in NF4 (QLoRA), once quantize_lora_base runs
    base_dtype: torch.dtype | None = None  # store every frozen parameter in this dtype; None: as it is


def apply_lora(model: nn.Module, options: LoRAOptions = LoRAOptions(), *, allow_no_targets: bool = False) -> nn.Module:
    """Add low-rank adapters to the linears `target_modules` names and freeze everything else.

    target_modules: last name segments (`wq`, `q_proj`) or globs over full names; `experts` adapts each
    routed expert's w1, w2, w3 (`experts.w1` one projection). None: every nn.Linear but the output head
    and MoE routers. quantize_base "nf4": the targets' frozen weights and every expert stack become NF4
    once `quantize_lora_base` runs. base_dtype: the frozen parameters' dtype (adapters keep the model's).
    allow_no_targets: a part holding no target (a pipeline stage) is only frozen, else an error.
    Apply first, on the meta or real model: before tensor parallelism and FSDP/DDP (refused with
    float8). After `materialize`, A is PEFT's kaiming-uniform and B zero.
    """
    rank, alpha, dropout, use_rslora = options.rank, options.alpha, options.dropout, options.use_rslora
    target_modules, quantize_base, base_dtype = options.target_modules, options.quantize_base, options.base_dtype
    _check_arguments(rank, alpha, dropout, quantize_base)
    refuse_data_parallel_model(model, "apply_lora")
    expert_targets = lora_expert_targets(model, target_modules, allow_no_targets)
    # matching no linear is an error only where nothing else is adapted
    optional = allow_no_targets or bool(expert_targets)
    targets = _matching(model, target_modules) if optional else lora_targets(model, target_modules)
    for name, linear in targets:
        if isinstance(linear.weight, DTensor) or type(linear) is not nn.Linear:
            raise TransformError("apply_lora", "model", f"{name} is a {type(linear).__name__}"
                                 f"{' split by tensor parallelism' if isinstance(linear.weight, DTensor) else ''}; "
                                 "apply_lora comes before float8 and tensor parallelism, on plain nn.Linear layers")
        if quantize_base == "nf4":
            check_nf4_shape(name, linear.weight.shape)
    experts = stacked_experts(model) if quantize_base == "nf4" else []
    for name, module in experts:
        for w in EXPERT_WEIGHTS:
            check_nf4_shape(f"{name}.{w} (one expert)", getattr(module, w).shape[1:])
    for param in model.parameters():
        param.requires_grad_(False)
    for _, module in experts:
        module.quantize_base = quantize_base
    for name, (module, projections) in expert_targets.items():
        add_expert_adapters(module, projections, rank, alpha, use_rslora)
        if not module.lora_A.get_parameter(projections[0]).is_meta:  # real: PEFT's init now, as for linears
            reset_expert_adapters(module, seed=0, name=name)
    modules = dict(model.named_modules())
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        lora = LoRALinear(linear, rank, alpha, dropout, use_rslora, quantize_base)
        if not linear.weight.is_meta:  # a real model: PEFT's init now (materialize does it for meta ones)
            reset_adapter(lora, seed=0, name=name)
        setattr(modules[parent_name], child, lora)
    for param in model.parameters():
        if base_dtype is not None and not param.requires_grad and param.dtype != base_dtype:
            param.data = param.data.to(base_dtype)  # in place: tied parameters stay one
    _log_adapters(model, targets, expert_targets, experts, options)
    return model


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """The model computing as its frozen base inside the block (PEFT's `disable_adapter`): every
    adapter's output is scaled by 0, so the outputs are the base's exactly; the scales come back after."""
    modules = [m for _, m in lora_modules(model)] + [m for _, m in expert_lora_modules(model)]
    scales = [(m, "scaling" if isinstance(m, LoRALinear) else "lora_scaling") for m in modules]
    saved = [getattr(m, name) for m, name in scales]
    try:
        for m, name in scales:
            setattr(m, name, 0.0)
        yield model
    finally:
        for (m, name), value in zip(scales, saved):
            setattr(m, name, value)


def stacked_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding routed experts as stacked 3-D weights w1, w2, w3 (models/common/moe.py)."""
    return [(n, m) for n, m in model.named_modules()
            if not isinstance(m, ExpertAdapters)
            and all(isinstance(getattr(m, w, None), (nn.Parameter, NF4Experts)) and len(getattr(m, w).shape) == 3
                    for w in EXPERT_WEIGHTS)]


def nf4_scaler_block(numel: int) -> int:
    """How many NF4 blocks share one scale factor in a weight of `numel` values: the largest number
    from NF4_SCALER_BLOCK down to NF4_MIN_SCALER_BLOCK that cuts its blocks into a multiple of
    NF4_GROUPS_MULTIPLE groups, so FSDP over 2, 4 or 8 ranks holds whole groups (Llama's weights
    keep 256, the debug model's 704-wide feed-forward gets 176); else NF4_SCALER_BLOCK. It depends
    on the size alone, so one process and every FSDP degree quantize a weight the same way."""
    blocks = numel // NF4_BLOCK
    for size in range(NF4_SCALER_BLOCK, NF4_MIN_SCALER_BLOCK - 1, -1):
        if blocks % size == 0 and (blocks // size) % NF4_GROUPS_MULTIPLE == 0:
            return size
    return NF4_SCALER_BLOCK


def check_nf4_shape(name: str, shape: torch.Size, shards: int = 1, function: str = "apply_lora") -> None:
    """NF4 needs the weight's size to divide by NF4_BLOCK * nf4_scaler_block values (a group of
    scales), and FSDP over `shards` ranks needs whole groups on each; name the layer if not."""
    numel = math.prod(shape)
    scaler_block = nf4_scaler_block(numel)
    group = NF4_BLOCK * scaler_block
    if numel % group:
        raise TransformError(
            function, "quantize_base",
            f"cannot quantize {name} {tuple(shape)} to NF4: its {numel} values do not divide into blocks of "
            f"{NF4_BLOCK} with scales grouped by {scaler_block} ({group} values); "
            "leave it out of target_modules or quantize_base"
        )
    if shape[0] % shards or (numel // group) % shards:
        raise TransformError(
            function, "quantize_base",
            f"cannot shard NF4 {name} {tuple(shape)} over {shards} FSDP ranks: its {numel // group} groups of "
            f"{group} values (and {shape[0]} rows) do not split evenly; use a data-parallel shard degree that divides them"
        )


def _check_arguments(rank: int, alpha: float, dropout: float, quantize_base: str | None) -> None:
    if not isinstance(rank, int) or rank <= 0:
        raise TransformError("apply_lora", "rank", f"rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise TransformError("apply_lora", "alpha", f"alpha must be > 0, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise TransformError("apply_lora", "dropout", f"dropout must be in [0, 1), got {dropout!r}")
    if quantize_base is not None and quantize_base not in QUANTIZE_BASE_CHOICES:
        raise TransformError("apply_lora", "quantize_base",
                             f"quantize_base must be None or one of {', '.join(QUANTIZE_BASE_CHOICES)}, got {quantize_base!r}")


def lora_targets(model: nn.Module, target_modules) -> list[tuple[str, nn.Linear]]:
    """The (name, linear) pairs `target_modules` selects (as `apply_lora` reads it); matching none
    is a TransformError that lists the linear names there are."""
    found = _matching(model, target_modules)
    if not found:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
        could = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise TransformError(
            "apply_lora", "target_modules",
            f"target_modules {target_modules!r} matches no nn.Linear of {type(model).__name__}; "
            f"its linears are named {', '.join(could) or '(none)'}"
        )
    return found


def _matching(model: nn.Module, target_modules) -> list[tuple[str, nn.Linear]]:
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    if target_modules is None:
        heads = {id(h) for h in [_output_embeddings(model)] if h is not None}
        return [(n, m) for n, m in linears
                if n not in OUTPUT_HEADS and id(m) not in heads and n.rsplit(".", 1)[-1] != ROUTER]
    patterns = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return [(n, m) for n, m in linears if any(_name_matches(n, p) for p in patterns)]


def lora_expert_targets(model: nn.Module, target_modules, allow_no_targets: bool = False
                        ) -> dict[str, tuple[nn.Module, list[str]]]:
    """The stacks of routed experts `target_modules` names: experts module name → (module, the
    projections to adapt, of its stacked weights: w1 w2 w3, or those it names in `stacked_weights`).
    A TransformError names a target such as `experts.w4` (no such projection) or `experts` where the
    model has no routed experts."""
    if target_modules is None:
        return {}
    patterns = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    stacks = adaptable_experts(model)
    weights = list(dict.fromkeys(w for _, module in stacks for w in _stacked_weights(module))) or list(EXPERT_WEIGHTS)
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for name, module in stacks:
        projections = [w for w in _stacked_weights(module)
                       if any(_name_matches(name, p) or _projection_matches(f"{name}.{w}", p) for p in patterns)]
        if projections:
            found[name] = (module, projections)
    for pattern in patterns:
        segments = pattern.split(".")
        if any(c in pattern for c in "*?[") or EXPERTS not in segments[-2:]:
            continue
        if segments[-1] != EXPERTS and segments[-1] not in weights:
            names = ", ".join([EXPERTS, *(f"{EXPERTS}.{w}" for w in weights)])
            raise TransformError("apply_lora", "target_modules", f"target_modules names {pattern!r}: routed experts "
                                 f"take adapters on {', '.join(weights)} ({names})")
        if not allow_no_targets and not any(_name_matches(n, pattern) or any(_projection_matches(f"{n}.{w}", pattern)
                                                                         for w in _stacked_weights(m)) for n, m in stacks):
            raise TransformError("apply_lora", "target_modules",
                                 f"target_modules names {pattern!r}, and {type(model).__name__} has no routed experts "
                                 f"(stacked {', '.join(weights)}) of that name; target its linears")
    return found


def names_routed_experts(target_modules) -> bool:
    """Whether `target_modules` names routed experts (`experts`, `experts.<weight>`, or a name or
    glob ending so), as `lora_expert_targets` reads it: before the model holds them (the
    transformers backend swaps in weft's grouped experts to adapt them)."""
    patterns = [] if target_modules is None else [target_modules] if isinstance(target_modules, str) else target_modules
    return any(EXPERTS in p.split(".")[-2:] for p in patterns)


def adaptable_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of stacked routed experts adapters can go on: weft's (`stacked_experts`) and
    those naming their own 3-D weights in `stacked_weights` (the transformers backend's
    `gate_up_proj` and `down_proj`, models/transformers/experts.py)."""
    return [(n, m) for n, m in model.named_modules()
            if not isinstance(m, ExpertAdapters)
            and all(isinstance(getattr(m, w, None), (nn.Parameter, NF4Experts)) and len(getattr(m, w).shape) == 3
                    for w in _stacked_weights(m))]


def _stacked_weights(module: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(module, "stacked_weights", EXPERT_WEIGHTS))


def _projection_matches(name: str, pattern: str) -> bool:
    """An expert projection's full name (`layers.1.feed_forward.experts.w1`) against a pattern:
    a glob over it, the name itself, or its tail (`experts.w1`)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or (name.endswith("." + pattern) and "." in pattern)


def _name_matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.rsplit(".", 1)[-1] == pattern


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def reset_adapter(module: LoRALinear, *, seed: int, name: str) -> None:
    """A drawn whole as PEFT does (kaiming-uniform, a = sqrt(5)) from a generator seeded by
    (seed, module name), each rank keeping its slice; B = 0. The same values in every layout."""
    _draw_peft_a(module.lora_A.weight, param_seed(seed, name), [slice(None)])
    module.lora_B.weight.zero_()


@torch.no_grad()
def reset_expert_adapters(experts: nn.Module, *, seed: int, name: str) -> None:
    """`reset_adapter` for the adapters of a stack of routed experts: each A ([experts, rank, in])
    drawn whole, expert after expert as PEFT draws one [rank, in] matrix (bound 1/sqrt(in)), from a
    generator seeded by (seed, parameter name); each rank keeps its experts' slice. B = 0."""
    for w, a in experts.lora_A.named_parameters():
        _draw_peft_a(a, param_seed(seed, f"{name}.lora_A.{w}"), range(a.shape[0]))
    for b in experts.lora_B.parameters():
        b.zero_()


def _draw_peft_a(a: torch.Tensor, seed: int, matrices) -> None:
    """Fill `a` (whole, or this rank's slice of it) with PEFT's kaiming-uniform draw of each of its
    `matrices` (indices of its leading dimension; a linear's A is one matrix), in turn from one
    generator seeded by `seed`."""
    device = a.device if not isinstance(a, DTensor) else a.to_local().device
    generator = torch.Generator(device=device).manual_seed(seed)
    full = torch.empty(a.shape, dtype=a.dtype, device=device)
    for matrix in matrices:
        nn.init.kaiming_uniform_(full[matrix], a=math.sqrt(5), generator=generator)
    with implicit_replication():
        a.copy_(full)


def expert_lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stacks of routed experts holding adapters (`lora_A`, `lora_B`), by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "lora_A", None), ExpertAdapters)]


def expert_adapter_ids(module: nn.Module) -> set[int]:
    """The ids of the routed experts' adapter parameters in `module` (spread with their experts by EP)."""
    return {id(p) for m in module.modules() if isinstance(m, ExpertAdapters) for p in m.parameters()}


def init_lora_adapters(model: nn.Module, seed: int, prefix: str = "") -> None:
    """Re-initialise every adapter (after the model's own init has filled them like any linear);
    prefix: `model`'s name in the whole model, whose names seed the draws."""
    full = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)  # noqa: E731
    for name, module in lora_modules(model):
        reset_adapter(module, seed=seed, name=full(name))
    for name, module in expert_lora_modules(model):
        reset_expert_adapters(module, seed=seed, name=full(name))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: the adapters follow their base's split
# ---------------------------------------------------------------------------------------------


class _LoRAColwise(ColwiseParallel):
    """Base split by output features; B split the same way, A whole on every rank."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if isinstance(module, LoRALinear):
            _distribute(module, "weight", device_mesh, Shard(0))
            _distribute(module, "bias", device_mesh, Shard(0))
            _distribute(module.lora_A, "weight", device_mesh, Replicate())
            _distribute(module.lora_B, "weight", device_mesh, Shard(0))
        elif isinstance(module, nn.Linear) and not _already_split(module):
            super()._partition_linear_fn(name, module, device_mesh)


class _LoRARowwise(RowwiseParallel):
    """Base split by input features; A split by input the same way, B whole on every rank (the
    adapter's partial sums are reduced with the base's)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if isinstance(module, LoRALinear):
            _distribute(module, "weight", device_mesh, Shard(1))
            _distribute(module, "bias", device_mesh, Replicate())
            _distribute(module.lora_A, "weight", device_mesh, Shard(1))
            _distribute(module.lora_B, "weight", device_mesh, Replicate())
        elif isinstance(module, nn.Linear) and not _already_split(module):
            super()._partition_linear_fn(name, module, device_mesh)


def _already_split(module: nn.Module) -> bool:
    """A LoRALinear's lora_A / lora_B, visited after their parent split them."""
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def _distribute(module: nn.Module, name: str, mesh, placement) -> None:
    param = getattr(module, name)
    if param is None:
        return
    module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                 requires_grad=param.requires_grad))


def lora_tp_style(style: ParallelStyle) -> ParallelStyle:
    """The style that splits a LoRALinear as `style` splits its base (column- or row-wise); a style
    that keeps its module whole (`keeps_module_whole`) applies to the LoRALinear as it is."""
    if getattr(style, "keeps_module_whole", False):
        return style
    if type(style) not in (ColwiseParallel, RowwiseParallel):
        raise TransformError("apply_tp", "plan", f"a LoRA layer can be split by ColwiseParallel or RowwiseParallel, "
                             f"not {type(style).__name__}")
    cls = _LoRAColwise if type(style) is ColwiseParallel else _LoRARowwise
    lora_style = cls.__new__(cls)
    lora_style.__dict__.update(style.__dict__)  # the same input/output layouts as the style given
    return lora_style


def lora_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with each entry that reaches a LoRALinear made to split its adapters too."""
    names = [n for n, _ in lora_modules(model)]
    return {path: lora_tp_style(style) if any(path_matches(n, path) for n in names) else style
            for path, style in plan.items()}


# ---------------------------------------------------------------------------------------------
# QLoRA: the frozen base in NF4
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def quantize_lora_base(model: nn.Module, device: torch.device | str | None = None, *, shards: int = 1,
                       log: bool = True) -> nn.Module:
    """Store each LoRALinear's frozen weight (where apply_lora was given quantize_base="nf4") as a
    torchao NF4 tensor, from its real values: call after materialize / loading the base, and
    before FSDP, which then shards the NF4 tensors. device: where the NF4 weights go (quantize
    on the CPU, keep on the GPU). shards: the FSDP degree that will shard them (checked to divide).
    Quantizing twice is a no-op."""
    NF4Tensor, to_nf4, _ = torchao_nf4()
    refuse_data_parallel_model(model, "quantize_lora_base")
    todo = [(n, m) for n, m in lora_modules(model) if m.quantize_base == "nf4" and not isinstance(m.weight, NF4Tensor)]
    experts = [(f"{n}.{w}", m, w) for n, m in stacked_experts(model) if getattr(m, "quantize_base", None) == "nf4"
               for w in EXPERT_WEIGHTS if isinstance(getattr(m, w), nn.Parameter)]
    for name, weight in [(f"{n}.weight", m.weight) for n, m in todo] + [(n, getattr(m, w)) for n, m, w in experts]:
        if weight.is_meta:  # every check before any weight changes
            raise TransformError("quantize_lora_base", "model", f"{name} is on the meta device; quantize "
                                 "real weights, after materialize or loading the base model")
    for name, module in todo:
        check_nf4_shape(name, module.weight.shape, shards, "quantize_lora_base")
    for name, module in todo:
        weight = module.weight.detach()
        nf4 = to_nf4(weight.to(device) if device is not None else weight, NF4_BLOCK, nf4_scaler_block(weight.numel()))
        module.weight = nn.Parameter(nf4, requires_grad=False)
    for _, module, w in experts:  # whole experts: FSDP and EP split the stack by expert, any degree
        nf4 = quantize_experts(getattr(module, w), device)
        delattr(module, w)  # the parameter gives way to the module holding its NF4 pieces
        setattr(module, w, nf4)
    if log and (todo or experts):
        logger.info(f"quantize_lora_base: {len(todo)} frozen base weights and {len(experts)} stacks of routed experts "
                    f"stored as NF4 (blocks of {NF4_BLOCK}, scales in groups of up to {NF4_SCALER_BLOCK})")
    return model


def quantize_experts(weight: torch.Tensor, device: torch.device | str | None = None) -> NF4Experts:
    """A stack of expert weights [experts, out, in] as NF4Experts, each expert quantized alone. A
    weight spread by expert parallelism (a Shard(0) DTensor) quantizes its local experts and keeps
    each piece of the stack spread the same way."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    local = local.detach().to(device) if device is not None else local.detach()
    nf4 = NF4Experts(local, NF4_BLOCK, nf4_scaler_block(local[0].numel()))
    if isinstance(weight, DTensor):
        for name, piece in list(nf4.named_parameters(recurse=False)):
            spread = DTensor.from_local(piece.data, weight.device_mesh, weight.placements, run_check=False)
            nf4.register_parameter(name, nn.Parameter(spread, requires_grad=False))
    return nf4


@torch.no_grad()
def dequantize_experts(model: nn.Module) -> nn.Module:
    """Every NF4 stack of routed experts back to a plain frozen [experts, out, in] weight in its
    original dtype, all experts on every rank (gathered where FSDP or EP spread them): for exports,
    which write the experts as Hugging Face weights."""
    for _, module in stacked_experts(model):
        for w in EXPERT_WEIGHTS:
            nf4 = getattr(module, w)
            if isinstance(nf4, NF4Experts):
                weight = nf4.dequantize(nf4.dtype, whole=True)
                delattr(module, w)
                module.register_parameter(w, nn.Parameter(weight, requires_grad=False))
    return model


def _log_adapters(model: nn.Module, targets, expert_targets, experts, options: LoRAOptions) -> None:
    """apply_lora's one line: what it adapted, its scaling, and how much of the model trains."""
    rank, dropout, quantize_base = options.rank, options.dropout, options.quantize_base
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    scaling = lora_scaling(options.alpha, rank, options.use_rslora)
    adapted = sorted({w for _, projections in expert_targets.values() for w in projections})
    on_experts = (f" and per expert on {sum(len(p) for _, p in expert_targets.values())} stacks of routed experts "
                  f"({', '.join(adapted)}) of {len(expert_targets)} MoE layers" if expert_targets else "")
    logger.info(
        f"apply_lora: adapters of rank {rank} on {len(targets)} linears "
        f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n, _ in targets})) or 'none here'}){on_experts}, "
        f"scaling {scaling:g}, dropout {dropout:g}{', base in NF4' if quantize_base else ''}"
        f"{f' (and the routed experts of {len(experts)} MoE layers)' if experts else ''}; trainable {trainable:,} of {total:,} "
        f"parameters ({100 * trainable / total:.3f}%)"
    )


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A in float32: what the adapted weight computes as (a stack of experts' expert
    by expert: [E, out, r] @ [E, r, in]); the merged export writes it, generate samples with it."""
    return weight.float() + scaling * (lora_b.float() @ lora_a.float())


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """A one-process model without adapters computing as the adapted one: each adapted weight
    replaced by `merged_weight` of it (float32), each LoRALinear by a plain nn.Linear, QLoRA's NF4
    weights by the weights they hold. The tensors a merged export writes, before its dtype."""
    refuse_data_parallel_model(model, "merge_adapters")
    dequantize_experts(model)
    for name, module in lora_modules(model):
        weight = module.weight.detach()
        weight = weight.get_original_weight() if hasattr(weight, "get_original_weight") else weight
        with torch.device("meta"):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        linear.weight = nn.Parameter(merged_weight(weight, module.lora_A.weight, module.lora_B.weight, module.scaling),
                                     requires_grad=False)
        linear.bias = module.bias
        model.set_submodule(name, linear)
    for _, module in expert_lora_modules(model):
        for w, lora_a in module.lora_A.named_parameters():
            merged = merged_weight(getattr(module, w), lora_a, getattr(module.lora_B, w), module.lora_scaling)
            delattr(module, w)
            module.register_parameter(w, nn.Parameter(merged, requires_grad=False))
        for attribute in ("lora_A", "lora_B", "lora_rank", "lora_alpha", "lora_use_rslora", "lora_scaling"):
            delattr(module, attribute)
    return model
