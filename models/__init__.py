"""weft's models and the registry of their specs (`models/common/spec.py`): the rest of weft finds a
model family here, never by importing its folder."""

from __future__ import annotations

from typing import Any

from torch import nn

from weft.models.llama.spec import LLAMA_SPEC
from weft.models.llama4.spec import LLAMA4_SPEC
from weft.models.qwen3.spec import QWEN3_SPEC
from weft.models.common.spec import Experts, HFConfigError, HFMapping, ModelSpec

MODEL_SPECS: tuple[ModelSpec, ...] = (LLAMA_SPEC, LLAMA4_SPEC, QWEN3_SPEC)


def flavors() -> dict[str, Any]:
    """Every registered flavor name -> its hyper-parameters."""
    return {name: args for spec in MODEL_SPECS for name, args in spec.flavors.items()}


def spec_for_flavor(flavor: str) -> ModelSpec:
    """The spec declaring `flavor` (KeyError naming it and the known flavors otherwise)."""
    for spec in MODEL_SPECS:
        if flavor in spec.flavors:
            return spec
    raise KeyError(f"unknown flavor {flavor!r}; expected one of {', '.join(flavors())}")


def spec_for_args(args: Any) -> ModelSpec:
    """The spec whose ModelArgs class `args` is an instance of."""
    for spec in MODEL_SPECS:
        if isinstance(args, spec.args_type):
            return spec
    raise TypeError(f"no model spec for hyper-parameters of type {type(args).__name__}")


def spec_for_model(model: nn.Module) -> ModelSpec | None:
    """The spec of a weft model (a pipeline stage or a wrapped one included), None for any other."""
    return next((spec for spec in MODEL_SPECS if isinstance(model, spec.model_type)), None)


def spec_for_hf_config(config: dict[str, Any]) -> ModelSpec:
    """The spec reading a config.json's model_type (Llama's, whose reader refuses with HFConfigError,
    for any other)."""
    return next((spec for spec in MODEL_SPECS if config.get("model_type") in spec.hf.model_types), LLAMA_SPEC)


__all__ = ["MODEL_SPECS", "Experts", "HFConfigError", "HFMapping", "ModelSpec", "flavors", "spec_for_args", "spec_for_flavor",
           "spec_for_hf_config", "spec_for_model"]
