"""Tensor parallelism: Megatron-style column/row splits of a model's linear layers over a TP mesh.

A plan maps module paths (`*` matches any one path component, e.g. every block) to PyTorch's
`ParallelStyle`s. `apply_tp` asks a model that declares its plan (`tensor_parallel_plan(...)`, as
weft's `Decoder` does; Llama's uses sequence parallelism), builds one for Hugging Face transformers
models from the plan their config declares; any other model passes one (`TPOptions(plan=...)`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from weft.errors import Conflict, TransformError, refuse_data_parallel_model
from weft.float8 import converted_modules, float8_tp_styles
from weft.parallelisms.lora import lora_modules, lora_tp_plan
from weft.parallelisms.plans import Plan, path_matches

logger = logging.getLogger("weft")


@dataclass(frozen=True)
class TPOptions:
    """`apply_tp`'s options."""

    plan: Plan | None = None  # module paths to ParallelStyles; None: the model's own plan
    loss_parallel: bool = False  # keep the logits vocabulary-sharded, for a loss under `loss_parallel()`
    float8_all_gather: bool = False  # weft's plan with torchao's float8 styles (after apply_float8; NCCL)


def check_tp_composes(quantize_base: str | None) -> None:
    """Tensor parallelism cannot split an NF4 base: torchao's NF4 tensors are sharded by FSDP only."""
    if quantize_base:
        raise TransformError("apply_tp", "tp_mesh", "does not support tensor parallelism; use FSDP, HSDP, context "
                             "parallelism or one device, or LoRA without quantize_base",
                             Conflict("QLoRA", "apply_lora", "quantize_base", quantize_base))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, options: TPOptions = TPOptions()) -> nn.Module:
    """Split the model's layers over `tp_mesh` following `plan`; return the model.

    plan None: the plan the model declares (weft's models' `tensor_parallel_plan`, a transformers
    model's `hf_tp_plan`). Column-split layers own whole output features (whole heads), row-split
    layers whole input features; every split must divide by the mesh size, checked before anything
    changes. loss_parallel False: the logits are gathered (a plain tensor); True: they stay
    vocabulary-sharded and the loss runs under `loss_parallel()`. float8_all_gather: torchao's float8
    styles (after apply_float8; NCCL). Apply after float8 and before context parallelism, activation
    checkpointing, compile and FSDP/DDP, on the meta-device or real model.
    """
    plan, loss_parallel, float8_all_gather = options.plan, options.loss_parallel, options.float8_all_gather
    refuse_data_parallel_model(model, "apply_tp")
    check_tp_composes(next((m.quantize_base for _, m in lora_modules(model) if m.quantize_base), None))
    tp = tp_mesh.size()
    if plan is None:  # a pipeline stage holds only some of the modules its model's plan names
        plan = _entries_present(model, default_tp_plan(model, loss_parallel=loss_parallel,
                                                       float8_all_gather=float8_all_gather))
    elif float8_all_gather:
        raise TransformError("apply_tp", "float8_all_gather", "float8_all_gather applies to weft's own plan only")
    plan = lora_tp_plan(model, plan)  # adapters (apply_lora came first) split with their base
    targets = _plan_targets(model, plan)
    _check_heads(model, tp)
    _check_split_dims(targets, tp)
    tied = _tied_places(model, targets)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for name, _, style in targets:  # by name, in the plan's order: a pattern some blocks lack (an MoE entry
        parallelize_module(model, tp_mesh, {name: style})  # in a dense block) is not warned of per block
    _retie_split(tied)
    for name, param in model.named_parameters():  # some styles re-create parameters trainable
        if name in frozen:
            param.requires_grad_(False)
    logger.info(
        f"apply_tp: split {len(targets)} modules over tp_mesh size {tp} "
        f"({_plan_name(model)} plan, loss_parallel={loss_parallel})"
    )
    return model


def check_tp_plan(model: nn.Module, tp: int) -> None:
    """What `apply_tp` checks before splitting `model` by its own plan over `tp` ranks (the styles
    translated, the heads and split dimensions divisible), on the meta model: TransformError if not."""
    targets = _plan_targets(model, _entries_present(model, default_tp_plan(model)))
    _check_heads(model, tp)
    _check_split_dims(targets, tp)


def default_tp_plan(model: nn.Module, *, loss_parallel: bool = False, float8_all_gather: bool = False) -> Plan:
    """The plan the model declares (`tensor_parallel_plan(loss_parallel=, float8_linears=, float8_styles=)`:
    weft's models), or the plan a transformers model declares; else an error asking for one."""
    if callable(declared := getattr(model, "tensor_parallel_plan", None)):
        if not float8_all_gather:
            return declared(loss_parallel=loss_parallel)
        return declared(loss_parallel=loss_parallel, float8_linears=converted_modules(model),
                        float8_styles=float8_tp_styles())
    if float8_all_gather:
        raise TransformError("apply_tp", "float8_all_gather", "float8_all_gather applies to weft's own plan only")
    if _hf_declared_plan(model):
        return hf_tp_plan(model, loss_parallel=loss_parallel)
    raise TransformError(
        "apply_tp", "plan", f"no tensor-parallel plan is known for {type(model).__name__}; pass plan="
        "{module path: ParallelStyle}"
    )


# The style names transformers (5.24 and 5.25) uses in `base_model_tp_plan` / `_tp_plan`, and what they
# mean in PyTorch's styles (transformers' own: transformers/distributed/tensor_parallel.py).
def _hf_style(name: str, loss_parallel: bool, head: bool, config) -> ParallelStyle | None:
    if name in ("colwise", "unit_colwise"):  # unit_*: whole heads per rank, as _check_heads requires of every plan
        return ColwiseParallel()
    if name in ("rowwise", "unit_rowwise"):
        return RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output") and head:  # the LM head: loss parallel may keep it split
        return _output_style(loss_parallel, input_layouts=Replicate())
    if name in ("colwise_rep", "colwise_gather_output", "embedding_colwise"):  # the caller uses the whole output
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name in ("rowwise_split_input", "rowwise_rep"):  # a whole input, each rank's share of it multiplied
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":  # a norm over each head, between colwise projections
        return ReplicatedOverSplitHeads()
    if name == "mla_kv_a_proj" and isinstance(getattr(config, "qk_rope_head_dim", None), int):
        return SharedRopeKeyGradSummed(config.qk_rope_head_dim)
    if name == "moe_tp_experts":  # the routed experts; the styles of their weights are left out (below)
        return ExpertsByExpert()
    return None


# The styles transformers declares for the weights of a `moe_tp_experts` module (its gate and up rows
# packed in one tensor, its down projection), which `ExpertsByExpert` replaces: it splits by expert.
_EXPERT_WEIGHT_STYLES = ("packed_colwise", "rowwise")
# Styles that leave their module whole on every rank, as a module the plan does not name is left.
_WHOLE_STYLES = ("replicate",)
# Why weft does not translate the styles transformers declares that it leaves out.
_UNTRANSLATED = {
    "local_params": "per-head parameters of its attention (sinks, gate biases) split on their own",
    "packed_colwise": "gate and up features packed in one weight, split half by half",
    "packed_rowwise": "gate and up features packed in one weight, split half by half",
    "all_reduce": "a module each rank computes a part of",
    "moe_identity_expert": "identity experts beside the routed ones",
    "sequence_parallel": "activations split along the sequence",
    "mla_kv_a_proj": "its config has no qk_rope_head_dim",
    "grouped_gemm": "an expert-parallel style",
    "ep_dispatch_experts": "an expert-parallel style",
}


class ExpertsByExpert(ParallelStyle):
    """Routed experts split by expert over the tp mesh: each weight the module stacks by expert
    (`stacked_weights`) becomes a Shard(0) DTensor, as `apply_ep` spreads them, so that checkpoints
    and exports see whole tensors in every layout. The tokens stay whole on every rank: each rank
    computes its own experts' share of every token's output, the shares are summed over the ranks,
    and so are the gradients of the module's inputs (the tokens and their routing weights).

    For a module called as transformers calls its experts (`hidden_states`, each token's chosen
    experts and their weights) whose `expert_parallel_method` computes `(x, counts)`, x sorted by
    expert (models/transformers/experts.py). The experts must divide by the mesh size."""

    def check(self, module: nn.Module, name: str, tp: int) -> None:
        """TransformError where `module` is not such experts, is already split, or tp does not divide them."""
        stacked = getattr(module, "stacked_weights", None)
        if not stacked or not callable(getattr(module, getattr(module, "expert_parallel_method", ""), None)):
            raise TransformError("apply_tp", "plan", f"{name} ({type(module).__name__}) is not a module of stacked "
                                 "experts computing its tokens sorted by expert (stacked_weights, expert_parallel_method)")
        if any(isinstance(getattr(module, w), DTensor) for w in stacked):
            raise TransformError("apply_tp", "model", f"{name}'s experts are already split (by apply_ep)")
        n_experts = getattr(module, stacked[0]).shape[0]
        if n_experts % tp:
            raise TransformError("apply_tp", "tp_mesh", f"tp_mesh size {tp} does not divide the {n_experts} experts of "
                                 f"{name}; each rank holds as many whole experts as the others")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(module, type(module).__name__, device_mesh.size())
        for name in module.stacked_weights:
            weight = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)]),
                                                         requires_grad=weight.requires_grad))
        module.__class__ = _by_expert_class(type(module))
        module.tp_mesh = device_mesh
        return module


def _sum_over_ranks(compute):
    """`compute` (a module's forward) on every rank's copy of the inputs, its outputs each rank's share."""

    def forward(self, hidden_states: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        # Every rank holds every token: each one's gradient of the inputs is its experts' part, summed.
        mesh = self.tp_mesh
        summed = [DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
                  if t.is_floating_point() else t for t in (hidden_states, *routing)]
        share = compute(self, *summed)
        return DTensor.from_local(share, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return forward


def _own_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # x holds counts[e] tokens for each expert e in turn; this rank computes those of its own experts
    # (one contiguous run of x) and gives the others' rows zeros.
    rank, local = self.tp_mesh.get_local_rank(), counts.numel() // self.tp_mesh.size()
    ends = [0, *counts.cumsum(0).tolist()]
    start, end = ends[rank * local], ends[(rank + 1) * local]
    computed = self.compute(x[start:end], counts[rank * local:(rank + 1) * local], *self.weights(lambda w: w.to_local()))
    return torch.cat([computed.new_zeros(start, computed.shape[1]), computed,
                      computed.new_zeros(x.shape[0] - end, computed.shape[1])])


def _by_expert_class(cls: type) -> type:
    """`cls` computing its rank's experts (as FSDP2 swaps a module's class for its own)."""
    if getattr(cls, "_experts_by_expert", False):
        return cls
    methods = {"forward": _sum_over_ranks(cls.forward), cls.expert_parallel_method: _own_experts}
    return type(f"ByExpert{cls.__name__}", (cls,), methods | {"_experts_by_expert": True})


class ReplicatedOverSplitHeads(ParallelStyle):
    """A module whose parameters stay whole on every rank while its input holds this rank's heads
    (Gemma 3's per-head q/k norms after the column-split q/k projections). The parameters become
    `Replicate()` DTensors and the input [..., heads, head_dim] a `Shard` of the heads, so each rank's
    parameter gradient is a `Partial` sum, all-reduced to `Replicate()` once accumulated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            whole = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))

        def heads_sharded(_, args):
            x, *rest = args
            for param in module.parameters(recurse=False):  # FSDP may register other objects: hook each once
                if param.requires_grad and not getattr(param, "_weft_sums_partial_grad", False):
                    param.register_post_accumulate_grad_hook(_replicate_grad)
                    param._weft_sums_partial_grad = True
            return DTensor.from_local(x, device_mesh, [Shard(x.ndim - 2)], run_check=False), *rest

        module.register_forward_pre_hook(heads_sharded)
        module.register_forward_hook(lambda _, __, out: out.to_local())
        return module


def _replicate_grad(param: torch.Tensor) -> None:
    if isinstance(param.grad, DTensor) and any(isinstance(p, Partial) for p in param.grad.placements):
        param.grad = param.grad.redistribute(placements=[Replicate()] * len(param.grad.placements))


class SharedRopeKeyGradSummed(ParallelStyle):
    """Multi-head latent attention's `kv_a_proj_with_mqa` (DeepSeek V2/V3 and their kin; transformers'
    `mla_kv_a_proj`), whole on every rank. Its output's first features are the latent key/value,
    which reaches this rank's heads through the column-split kv_b_proj (whose input gradient is
    summed over the ranks already); its last `rope_dim` features are the rotary key that every head
    shares, which reaches this rank's heads directly: each rank's gradient of it covers its own
    heads only, so it is summed over the ranks here (a LoRALinear's output too: its adapters stay whole)."""

    keeps_module_whole = True

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def rope_grad_summed(_, __, out: torch.Tensor) -> torch.Tensor:
            latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(rope_grad_summed)
        return module


def hf_tp_plan(model: nn.Module, *, loss_parallel: bool = False) -> Plan:
    """The plan a transformers model declares (`model._tp_plan`, else its config's
    `base_model_tp_plan` under the base model's prefix), in PyTorch styles; TransformError naming
    the family and the style where it declares one weft does not translate.

    Activations between the splits stay replicated (no sequence parallelism): attention and
    MLP inputs are whole on every rank, their outputs all-reduced. Routed experts are split by
    expert (`ExpertsByExpert`): those the plan names `moe_tp_experts`, and those its expert-parallel
    plan names `ep_dispatch_experts` (where transformers 5.25 moved them) where weft's grouped
    experts compute them (all their weights stacked by expert); other experts stay whole.
    """
    declared = _hf_declared_plan(model)
    experts = [path for path, name in declared.items() if name == "moe_tp_experts"]
    head, config = _output_embeddings_path(model), _text_config(model)
    styles = {path: (name, _hf_style(name, loss_parallel, head=path == head, config=config))
              for path, name in declared.items() if name not in _WHOLE_STYLES and not (
                  name in _EXPERT_WEIGHT_STYLES and any(path.rpartition(".")[0] == e for e in experts))}
    params = [name for name, _ in model.named_parameters()]  # a style weft has none for first, then parameters
    for path, (name, style) in sorted(styles.items(), key=lambda item: item[1][1] is not None):
        if style is None or any(path_matches(p, path) for p in params):
            what = "a parameter split on its own" if style is not None else \
                _UNTRANSLATED.get(name, "a style this weft does not know")
            raise TransformError(
                "apply_tp", "plan", f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)}) "
                f"declares the tensor-parallel style {name!r} for {path} ({what}), which weft does not translate; "
                "train it without tensor parallelism (FSDP or HSDP shard it)"
            )
    plan = {path: style for path, (_, style) in styles.items()}
    return plan | _experts_by_expert(model, plan) | _per_head_norms(model, declared)


def _experts_by_expert(model: nn.Module, plan: Plan) -> Plan:
    """The routed experts the model's expert-parallel plan names (`ep_dispatch_experts`) that `plan`
    leaves out, split by expert where every weight they hold is stacked by expert (weft's grouped
    experts: models/transformers/experts.py); experts holding others (gpt-oss's biases) stay whole."""
    modules = dict(model.named_modules())
    split = {}
    for path, name in _hf_declared_plan(model, "ep").items():
        found = [m for n, m in modules.items() if n and path_matches(n, path)]
        if name == "ep_dispatch_experts" and path not in plan and found and all(map(_stacked_only, found)):
            split[path] = ExpertsByExpert()
    return split


def _stacked_only(module: nn.Module) -> bool:
    """Whether `module` computes experts sorted by expert and holds only weights stacked by expert."""
    stacked = getattr(module, "stacked_weights", ())
    return callable(getattr(module, getattr(module, "expert_parallel_method", ""), None)) and \
        {name for name, _ in module.named_parameters(recurse=False)} == set(stacked)


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _per_head_norms(model: nn.Module, declared: dict[str, str]) -> Plan:
    """The q/k norms that the plan leaves out while it splits their projections by head (GLM-4 MoE's
    `use_qk_norm`), one weight shared by every head ([head_dim]): whole weights over each rank's
    heads, their gradients summed, as Gemma 3's plan declares its own (`replicated_with_grad_allreduce`).
    Left alone, each rank's copy would train on its own heads' gradient only and drift from the others'."""
    modules = dict(model.named_modules())
    plan = {}
    for path, name in declared.items():
        attention, _, projection = path.rpartition(".")
        norm = f"{attention}.{projection[0]}_norm"
        if name != "colwise" or projection not in ("q_proj", "k_proj") or norm in declared:
            continue
        norms = [m for n, m in modules.items() if n and path_matches(n, norm)]
        if norms and all(getattr(getattr(m, "weight", None), "ndim", 0) == 1 for m in norms):
            plan[norm] = ReplicatedOverSplitHeads()
    return plan


def _output_embeddings_path(model: nn.Module) -> str | None:
    """The module path of the model's output projection (transformers' `get_output_embeddings`)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((name for name, module in model.named_modules() if module is head), None) if head is not None else None


def _hf_declared_plan(model: nn.Module, kind: str = "tp") -> dict[str, str]:
    """The tensor-parallel (kind "tp") or expert-parallel ("ep") plan a transformers model declares:
    its `_tp_plan` / `_ep_plan`, else its config's `base_model_*_plan` under the base model's prefix."""
    declared = getattr(model, f"_{kind}_plan", None)
    if isinstance(declared, dict) and declared:
        return dict(declared)
    base = getattr(getattr(model, "config", None), f"base_model_{kind}_plan", None)
    if not isinstance(base, dict) or not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {f"{prefix}{path}": style for path, style in base.items()}


def _output_style(loss_parallel: bool, input_layouts) -> ParallelStyle:
    """The output projection, split by vocabulary; logits sharded (loss parallel) or gathered."""
    return ColwiseParallel(
        input_layouts=input_layouts,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def _plan_name(model: nn.Module) -> str:
    return type(model).__name__


def _plan_targets(model: nn.Module, plan: Plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, module, style) for every module a plan entry matches; an entry matching none is an error."""
    modules = dict(model.named_modules())
    targets = []
    for pattern, style in plan.items():
        matched = [name for name in modules if name and path_matches(name, pattern)]
        if not matched:
            raise TransformError("apply_tp", "plan", f"plan entry {pattern!r} matches no module of {type(model).__name__}")
        targets += [(name, modules[name], style) for name in matched]
    return targets


def _entries_present(model: nn.Module, plan: Plan) -> Plan:
    """The plan's entries that match a module of the model."""
    names = [name for name, _ in model.named_modules() if name]
    return {pattern: style for pattern, style in plan.items() if any(path_matches(n, pattern) for n in names)}


def _check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads must split evenly: each rank owns whole query and key/value heads."""
    args, config = getattr(model, "args", None), getattr(model, "config", None)
    counts = {}
    if args is not None and hasattr(args, "n_heads"):
        counts = {"n_heads": args.n_heads, "n_kv_heads": getattr(args, "kv_heads", args.n_heads)}
    elif config is not None:
        for name in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(config, name, None), int):
                counts[name] = getattr(config, name)
    for name, heads in counts.items():
        if heads % tp:
            raise TransformError("apply_tp", "tp_mesh", f"tp_mesh size {tp} does not divide {name} {heads}")


def _check_split_dims(targets: list[tuple[str, nn.Module, ParallelStyle]], tp: int) -> None:
    """Every dimension a style splits must divide by the mesh size (read from the weight shapes)."""
    for name, module, style in targets:
        if callable(check := getattr(style, "check", None)):  # a style checking its module itself
            check(module, name, tp)
            continue
        if (dims := getattr(style, "weight_split_dims", None)) is not None:  # a style naming what it splits
            for weight_name, dim in dims.items():
                size = getattr(module, weight_name).shape[dim]
                if size % tp:
                    raise TransformError("apply_tp", "tp_mesh", f"tp_mesh size {tp} does not divide the experts' hidden "
                                         f"dimension (size {size}) of {name}.{weight_name}")
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2:
            continue
        if isinstance(style, ColwiseParallel):
            dim = 1 if isinstance(module, nn.Embedding) else 0
        elif isinstance(style, RowwiseParallel):
            dim = 0 if isinstance(module, nn.Embedding) else 1
        else:
            continue
        if weight.shape[dim] % tp:
            raise TransformError(
                "apply_tp", "tp_mesh",
                f"tp_mesh size {tp} does not divide dim {dim} (size {weight.shape[dim]}) of {name}.weight",
            )


def _tied_places(model: nn.Module, targets: list[tuple[str, nn.Module, ParallelStyle]]) -> list[list[tuple[str, nn.Module, str]]]:
    """Each split parameter registered in more than one place (tied embeddings), as
    (module path, module, attribute) places. A tie is kept only if every place is split by the plan."""
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((path, module, attr))
    split = {id(module) for _, module, _ in targets}
    groups = []
    for group in places.values():
        in_plan = [id(module) in split for _, module, _ in group]
        if len(group) > 1 and any(in_plan):
            names = " and ".join(f"{path}.{attr}" for path, _, attr in group)
            if not all(in_plan):
                raise TransformError("apply_tp", "model", f"tensor parallelism cannot split tied parameters ({names} "
                                     "are one tensor) unless the plan splits every module holding it")
            groups.append(group)
    return groups


def _retie_split(tied: list[list[tuple[str, nn.Module, str]]]) -> None:
    """`parallelize_module` gives each place of a tied parameter its own DTensor; put the first back
    in the others when they are split alike (weft's embedding and output both by vocabulary rows)."""
    for (first_path, first, first_attr), *others in tied:
        param = first._parameters[first_attr]
        for path, module, attr in others:
            mine = module._parameters[attr]
            if getattr(mine, "placements", None) != getattr(param, "placements", None):
                raise TransformError("apply_tp", "model", f"tied parameters {first_path}.{first_attr} and {path}.{attr} "
                                     f"are split differently ({param.placements} and {mine.placements})")
            module._parameters[attr] = param
