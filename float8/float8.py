"""Float8 training: run Llama's linear layers on float8 matmuls through torchao's `Float8Linear`.

`apply_float8` swaps the eligible `nn.Linear` layers of a model for torchao's `Float8Linear`
(recipes tensorwise and rowwise), first among the transforms, on the meta-device model. A layer
stays in high precision when `filter_fqns` names it, it is a router, its features are not
multiples of 16 or below `min_dim` (and, with `auto_filter`, by torchao's size filter).
`check_float8_support` refuses, before any work, what cannot run (no torchao, GPUs before 8.9,
float8 all-gather over gloo); torchao is imported only when needed. Why: docs/float8.md.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from weft.errors import Conflict, TransformError, UserError, refuse_data_parallel_model
from weft.layers import ROUTER
from weft.layers.torchao_import import quiet_torchao_import

logger = logging.getLogger("weft")

# What to tell a user whose machine cannot import torchao. 0.17.0 is the release built for
# torch 2.11; newer torch pairs with newer torchao (https://github.com/pytorch/ao#installation).
TORCHAO_HINT = "install torchao (pip install torchao; 0.17.0 is the release for torch 2.11)"


class Float8Unavailable(UserError):
    """float8 was asked for where torchao cannot be imported; the message is one line."""


@functools.cache
def _torchao():
    """Import torchao's float8 training API on first use, and only then.

    torchao is needed by float8 runs alone: a bf16 run must start where torchao is missing, or
    installed for another torch and broken on import. Its start-up noise is dropped where weft
    imports it (layers/torchao_import.py).
    """
    try:
        with quiet_torchao_import():
            from torchao import float8 as ao_float8
            from torchao.float8 import float8_linear, float8_linear_utils, float8_tensor_parallel
    except Exception as error:  # ImportError, or a torchao built for another torch failing inside
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise Float8Unavailable(
            f"float8.enable: torchao cannot be imported ({type(error).__name__}: {first_line}); {TORCHAO_HINT}, "
            "or set float8.enable = false"
        ) from None
    return SimpleNamespace(
        Float8LinearConfig=ao_float8.Float8LinearConfig,
        convert_to_float8_training=ao_float8.convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp=ao_float8.precompute_float8_dynamic_scale_for_fsdp,
        Float8Linear=float8_linear.Float8Linear,
        # private in torchao 0.17/0.18; only float8.auto_filter reaches for it
        auto_filter_for_recipe=getattr(float8_linear_utils, "_auto_filter_for_recipe", None),
        Float8ColwiseParallel=float8_tensor_parallel.Float8ColwiseParallel,
        Float8RowwiseParallel=float8_tensor_parallel.Float8RowwiseParallel,
        PrepareFloat8ModuleInput=float8_tensor_parallel.PrepareFloat8ModuleInput,
    )


RECIPES = ("tensorwise", "rowwise")
DEFAULT_MIN_DIM = 1024
MIN_CUDA_CAPABILITY = (8, 9)
_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class Float8Options:
    """`apply_float8`'s options."""

    recipe: str = "tensorwise"  # scaling granularity: "tensorwise" or "rowwise"
    filter_fqns: tuple[str, ...] = ()  # layers kept in high precision, by whole dotted components of their names
    enable_fsdp_float8_all_gather: bool = False  # FSDP all-gathers the weights in float8 (tensorwise only)
    min_dim: int = DEFAULT_MIN_DIM  # layers with a dimension below this stay in high precision
    auto_filter: bool = False  # also keep those torchao's size filter for the recipe would not convert


def check_float8_composes(lora: bool) -> None:
    """Float8 cannot train LoRA: it would swap each adapted layer's frozen base for a Float8Linear."""
    if lora:
        raise TransformError("apply_float8", None, "and float8 together are not supported: float8 would swap the "
                             "frozen base of each adapted layer for a Float8Linear; turn one of them off",
                             Conflict("LoRA", "apply_lora"))


def apply_float8(model: nn.Module, options: Float8Options = Float8Options()) -> nn.Module:
    """Swap the model's eligible `nn.Linear` layers for torchao `Float8Linear`, in place.

    filter_fqns: layers kept in high precision. An entry matches a layer when it is a run of
    whole dotted components of the layer's name: "output" matches `output`, "w2" every
    `layers.N.feed_forward.w2`, "layers.1" every linear of block 1 (but not of block 10).
    Layers whose dimensions are not multiples of 16, or below `min_dim`, are kept too, and with
    `auto_filter` those torchao's size filter for the recipe would not convert. No name
    is filtered by default: pass the output projection's name (weft: "output", transformers:
    "lm_head") to keep it in high precision.
    Logs one line saying what was converted and what was kept, and why.
    Apply first, before tensor parallelism and FSDP/DDP.
    """
    refuse_data_parallel_model(model, "apply_float8")
    check_float8_composes(any(hasattr(module, "lora_A") for module in model.modules()))  # weft's or PEFT's LoRA layers
    recipe, min_dim, auto_filter = options.recipe, options.min_dim, options.auto_filter
    config = _float8_config(recipe, options.enable_fsdp_float8_all_gather)
    already = converted_modules(model)
    if already:
        raise ValueError(f"apply_float8: the model already has Float8Linear layers ({already[0]}, ...)")
    filter_fqns = tuple(options.filter_fqns)
    kept: dict[str, list[str]] = {}
    torchao_filter = None
    if auto_filter:
        if _torchao().auto_filter_for_recipe is None:
            raise TransformError("apply_float8", "auto_filter", "this torchao has no _auto_filter_for_recipe (0.17 and "
                                 "0.18 do); leave auto_filter off")
        torchao_filter = _torchao().auto_filter_for_recipe(recipe, [])

    def convert(linear: nn.Module, fqn: str) -> bool:
        reason = _reason_to_keep(fqn, linear, filter_fqns, min_dim)
        if reason is None and torchao_filter is not None and not torchao_filter(linear, fqn):
            reason = "torchao's auto_filter: too small to gain"
        if reason is not None:
            kept.setdefault(reason, []).append(fqn)
        return reason is None

    _torchao().convert_to_float8_training(model, config=config, module_filter_fn=convert)
    logger.info(_summary(recipe, len(converted_modules(model)), kept))
    return model


def converted_modules(model: nn.Module) -> list[str]:
    """Names of the model's `Float8Linear` layers, in module order.

    Without torchao imported no layer can be a Float8Linear, so this does not import it.
    """
    if "torchao.float8.float8_linear" not in sys.modules:
        return []
    float8_linear = _torchao().Float8Linear
    return [name for name, module in model.named_modules() if isinstance(module, float8_linear)]


def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the float8 scales of all FSDP-sharded float8 weights in one all-reduce.

    Call after every optimizer step when `enable_fsdp_float8_all_gather` and
    `precompute_float8_dynamic_scale_for_fsdp` are on; the next all-gathers then use them.
    """
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def float8_tp_all_gather(device_type: str, backend: str | None, recipe: str) -> bool:
    """Whether tensor parallelism should all-gather activations in float8 (`float8_tp_styles`).

    Yes for the tensorwise recipe when the backend can carry float8 tensors (NCCL on a GPU);
    no for rowwise (torchao's float8 styles are tensorwise only) and with gloo.
    """
    return recipe == "tensorwise" and _float8_collectives(device_type, backend)


def check_float8_support(
    device_type: str,
    backend: str | None,
    *,
    recipe: str = "tensorwise",
    enable_fsdp_float8_all_gather: bool = False,
    precompute_float8_dynamic_scale_for_fsdp: bool = False,
    tp_degree: int = 1,
) -> list[str]:
    """Check a float8 setup before any work: raise ValueError (one line) where it cannot run.

    Returns the warnings to log, one line each: today only that tensor-parallel activations
    will be all-gathered in high precision because the backend cannot carry float8.
    """
    _torchao()  # raises Float8Unavailable (a ValueError) where torchao cannot be imported
    _check_recipe(recipe, enable_fsdp_float8_all_gather)
    if precompute_float8_dynamic_scale_for_fsdp and not enable_fsdp_float8_all_gather:
        raise ValueError(
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true"
        )
    if enable_fsdp_float8_all_gather and not _float8_collectives(device_type, backend):
        raise ValueError(
            f"float8.enable_fsdp_float8_all_gather: the {backend} backend on {device_type} cannot all-gather "
            "float8 tensors (NCCL on a GPU can); set it to false"
        )
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CUDA_CAPABILITY:
            raise ValueError(
                f"float8 needs a GPU of compute capability {'.'.join(map(str, MIN_CUDA_CAPABILITY))} or newer "
                f"for float8 matmuls; {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}"
            )
    warnings = []
    if tp_degree > 1 and recipe == "tensorwise" and not _float8_collectives(device_type, backend):
        warnings.append(
            f"float8: the {backend} backend cannot all-gather float8 tensors, so tensor parallelism "
            "all-gathers activations in high precision (matmuls still run in float8)"
        )
    return warnings


def check_float8_compute(device_type: str, recipe: str, compute_dtype: torch.dtype, matmul_tokens: int) -> None:
    """What a GPU's float8 matmuls need of the run, checked up front (ValueError, one line); the
    CPU kernel needs neither. The rowwise recipe needs bf16 compute (rowwise-scaled `_scaled_mm`
    writes bf16 only), and `_scaled_mm` needs every dimension a multiple of 16, including the
    tokens of one micro-batch per device (local batch x seq_len / cp), which the weight-gradient
    matmul reduces over. Needs no torchao: a dry run checks it anywhere."""
    if device_type != "cuda":
        return
    if recipe == "rowwise" and compute_dtype != torch.bfloat16:
        raise ValueError(f"float8.recipe = rowwise: needs bf16 compute on a GPU (rowwise-scaled float8 matmuls "
                         f"output bf16 only), this run computes in {str(compute_dtype).removeprefix('torch.')}; "
                         "set training.mixed_precision_param = bfloat16")
    if matmul_tokens % _DIM_MULTIPLE:
        raise ValueError(f"float8.enable: float8 matmuls need the tokens of one micro-batch per device "
                         f"(training.local_batch_size x training.seq_len / parallelism.cp = {matmul_tokens}) "
                         f"to be a multiple of {_DIM_MULTIPLE}")


def float8_tp_styles() -> dict[str, type[ParallelStyle]]:
    """torchao's tensor-parallel styles that all-gather activations in float8 (tensorwise only).

    Drop-in replacements for ColwiseParallel, RowwiseParallel and PrepareModuleInput on blocks
    whose linear layers are all `Float8Linear`; they need float8 collectives (NCCL).
    """
    ao = _torchao()
    return {
        "colwise": ao.Float8ColwiseParallel,
        "rowwise": ao.Float8RowwiseParallel,
        "prepare_input": ao.PrepareFloat8ModuleInput,
    }


def _float8_collectives(device_type: str, backend: str | None) -> bool:
    """Whether collectives can carry float8 tensors; backend None: no process group, no collectives."""
    return backend is None or (device_type != "cpu" and backend != "gloo")


def _check_recipe(recipe: str, enable_fsdp_float8_all_gather: bool) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"float8.recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    if enable_fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"float8.enable_fsdp_float8_all_gather needs float8.recipe = tensorwise, got {recipe!r}")


def _float8_config(recipe: str, enable_fsdp_float8_all_gather: bool):
    """torchao's Float8LinearConfig for the recipe."""
    _check_recipe(recipe, enable_fsdp_float8_all_gather)
    config_type = _torchao().Float8LinearConfig
    if recipe == "rowwise":
        return config_type.from_recipe_name("rowwise")
    return config_type(enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)


def _reason_to_keep(fqn: str, linear: nn.Module, filter_fqns: tuple[str, ...], min_dim: int) -> str | None:
    """Why this linear layer stays in high precision, or None to convert it."""
    if any(f".{entry}." in f".{fqn}." for entry in filter_fqns):
        return "filter_fqns"
    if fqn.rsplit(".", 1)[-1] == ROUTER:
        return "an MoE router (float8 rounding would move the routing)"
    dims = (linear.in_features, linear.out_features)
    if any(d % _DIM_MULTIPLE for d in dims):
        return f"dims not multiples of {_DIM_MULTIPLE}"
    if min(dims) < min_dim:
        return f"a dim below min_dim {min_dim}"
    return None


def _summary(recipe: str, n_converted: int, kept: dict[str, list[str]]) -> str:
    """One log line; block indices are folded ("layers.*.attention.wk") to keep it short."""
    line = f"apply_float8 ({recipe}): converted {n_converted} linear layers"
    if kept:
        groups = []
        for reason, names in kept.items():
            folded = dict.fromkeys(re.sub(r"(?<![^.])\d+(?=\.|$)", "*", name) for name in names)
            groups.append(f"{', '.join(folded)} ({reason})")
        line += f", kept {'; '.join(groups)} in high precision"
    return line
