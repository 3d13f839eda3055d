"""Tensor parallelism: Megatron-style column/row splits of a model's linear layers over a TP mesh.

A plan maps module paths (`*` matches any one path component, e.g. every block) to PyTorch's
`ParallelStyle`s. `apply_tp` brings its own plan for weft's Llama (with sequence parallelism)
and builds one for Hugging Face transformers models from the plan their config declares; any
other model passes `plan=`.
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from models.llama import Transformer
from parallelisms.common import TransformError, refuse_data_parallel_model
from parallelisms.lora import lora_tp_plan

logger = logging.getLogger("weft")

Plan = dict[str, ParallelStyle]


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Plan | None = None,
    *,
    loss_parallel: bool = True,
    float8_all_gather: bool = False,
) -> nn.Module:
    """Split the model's layers over `tp_mesh` following `plan`; return the model.

    plan None: weft's Llama plan (`llama_tp_plan`) for weft's `Transformer`, the model's own
    declared plan for a transformers model (`hf_tp_plan`). Column-split layers own whole
    output features (whole heads), row-split layers whole input features; the heads and every
    split dimension must be divisible by the mesh size, which is checked before anything changes.

    loss_parallel: the output projection's logits stay vocabulary-sharded (a DTensor); compute
    the loss under `torch.distributed.tensor.parallel.loss_parallel()`. Otherwise they are
    gathered. float8_all_gather: weft's plan with torchao's float8 styles (apply_float8 came
    first; needs NCCL).

    Apply after float8 and before context parallelism, activation checkpointing, compile and
    FSDP/DDP, on the meta-device or real model.
    """
    refuse_data_parallel_model(model, "apply_tp")
    tp = tp_mesh.size()
    if plan is None:
        plan = default_tp_plan(model, loss_parallel=loss_parallel, float8_all_gather=float8_all_gather)
    elif float8_all_gather:
        raise TransformError("apply_tp", "float8_all_gather", "float8_all_gather applies to weft's own plan only")
    plan = lora_tp_plan(model, plan)  # adapters (apply_lora came first) split with their base
    targets = _plan_targets(model, plan)
    _check_heads(model, tp)
    _check_split_dims(targets, tp)
    _check_not_tied(model, targets)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():  # some styles re-create parameters trainable
        if name in frozen:
            param.requires_grad_(False)
    logger.info(
        f"apply_tp: split {len(targets)} modules over tp_mesh size {tp} "
        f"({_plan_name(model)} plan, loss_parallel={loss_parallel})"
    )
    return model


def default_tp_plan(model: nn.Module, *, loss_parallel: bool = True, float8_all_gather: bool = False) -> Plan:
    """weft's Llama plan, or the plan a transformers model declares; else an error asking for one."""
    if isinstance(model, Transformer):
        return llama_tp_plan(loss_parallel=loss_parallel, float8_all_gather=float8_all_gather)
    if float8_all_gather:
        raise TransformError("apply_tp", "float8_all_gather", "float8_all_gather applies to weft's own plan only")
    if _hf_declared_plan(model):
        return hf_tp_plan(model, loss_parallel=loss_parallel)
    raise TransformError(
        "apply_tp", "plan", f"no tensor-parallel plan is known for {type(model).__name__}; pass plan="
        "{module path: ParallelStyle}"
    )


def llama_tp_plan(*, loss_parallel: bool = True, float8_all_gather: bool = False) -> Plan:
    """weft's Llama: each block's wq/wk/wv and w1/w3 split by output features (each rank owns whole
    heads, so grouped-query attention stays local), wo and w2 by input features.

    Between the splits the activations are sequence-parallel: the residual stream and the norms
    hold 1/tp of the tokens, all-gathered before attention and the feed-forward and
    reduce-scattered after them. The embedding is split by vocabulary, and so is the output.
    """
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8_all_gather:
        from float8 import float8_tp_styles

        styles = float8_tp_styles()
        colwise, rowwise, prepare_input = styles["colwise"], styles["rowwise"], styles["prepare_input"]
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": _output_style(loss_parallel, input_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        # Attention and the feed-forward need the whole sequence: gather it at their entrance.
        # The rotary rotations (the attention's other input) are a plain tensor and pass through.
        "layers.*.attention": prepare_input(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": colwise(),
        "layers.*.attention.wk": colwise(),
        "layers.*.attention.wv": colwise(),
        "layers.*.attention.wo": rowwise(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": colwise(),
        "layers.*.feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": colwise(),
    }


# The style names transformers uses in `base_model_tp_plan` / `_tp_plan`, and what they mean.
def _hf_style(name: str, loss_parallel: bool) -> ParallelStyle | None:
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):  # the LM head
        return _output_style(loss_parallel, input_layouts=Replicate())
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    return None


def hf_tp_plan(model: nn.Module, *, loss_parallel: bool = True) -> Plan:
    """The plan a transformers model declares (`model._tp_plan`, else its config's
    `base_model_tp_plan` under the base model's prefix), in PyTorch styles.

    Activations between the splits stay replicated (no sequence parallelism): attention and
    MLP inputs are whole on every rank, their outputs all-reduced.
    """
    plan = {}
    for path, name in _hf_declared_plan(model).items():
        style = _hf_style(name, loss_parallel)
        if style is None:
            raise TransformError(
                "apply_tp", "plan", f"{type(model).__name__} declares style {name!r} for {path}, which weft does "
                "not translate; pass plan= explicitly"
            )
        plan[path] = style
    return plan


def _hf_declared_plan(model: nn.Module) -> dict[str, str]:
    declared = getattr(model, "_tp_plan", None)
    if isinstance(declared, dict) and declared:
        return dict(declared)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
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
    return "weft Llama" if isinstance(model, Transformer) else type(model).__name__


def _plan_targets(model: nn.Module, plan: Plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(name, module, style) for every module a plan entry matches; an entry matching none is an error."""
    modules = dict(model.named_modules())
    targets = []
    for pattern, style in plan.items():
        matched = [name for name in modules if name and _path_matches(name, pattern)]
        if not matched:
            raise TransformError("apply_tp", "plan", f"plan entry {pattern!r} matches no module of {type(model).__name__}")
        targets += [(name, modules[name], style) for name in matched]
    return targets


def _path_matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


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


def _check_not_tied(model: nn.Module, targets: list[tuple[str, nn.Module, ParallelStyle]]) -> None:
    """A split parameter shared with another module would come apart: each would get its own DTensor."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    for name, module, _ in targets:
        for param in module.parameters(recurse=False):
            aliases = names_by_param.get(id(param), [])
            if len(aliases) > 1:
                raise TransformError(
                    "apply_tp", "model",
                    f"tensor parallelism does not support tied parameters ({' and '.join(aliases)} are one tensor)",
                )
