"""weft's models and the registry of their specs (`models/common/spec.py`): the rest of weft finds a
model family here, never by importing its folder."""

from __future__ import annotations

from typing import Any

from torch import nn

from weft.models.common.spec import Experts, HFConfigError, HFMapping, ModelSpec
from weft.models.gpt_oss.spec import GPT_OSS_SPEC
from weft.models.llama.spec import LLAMA_SPEC
from weft.models.llama4.spec import LLAMA4_SPEC
from weft.models.qwen3.spec import QWEN3_SPEC
from weft.models.transformers.spec import TRANSFORMERS_SPEC

MODEL_SPECS: tuple[ModelSpec, ...] = (LLAMA_SPEC, LLAMA4_SPEC, QWEN3_SPEC, GPT_OSS_SPEC)
ALL_SPECS: tuple[ModelSpec, ...] = (*MODEL_SPECS, TRANSFORMERS_SPEC)  # weft's families and the transformers backend
BACKENDS = ("auto", "weft", "transformers")  # model.backend: who builds a Hugging Face folder's model


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
    """The spec whose ModelArgs class `args` is an instance of (the transformers backend's included)."""
    for spec in ALL_SPECS:
        if isinstance(args, spec.args_type):
            return spec
    raise TypeError(f"no model spec for hyper-parameters of type {type(args).__name__}")


def chosen_backend(backend: str, recorded: str) -> str:
    """model.backend as given, or for "auto" the backend `recorded` by the run a checkpoint comes from."""
    return recorded if backend == "auto" else backend


def builds_flavors(backend: str) -> bool:
    """Whether model.backend `backend` builds weft's named flavors (the transformers backend builds
    the model of a Hugging Face folder only, having no flavors of its own)."""
    return backend != TRANSFORMERS_SPEC.backend.name


def spec_for_model(model: nn.Module) -> ModelSpec | None:
    """The spec of a weft model (a pipeline stage or a wrapped one included), None for any other."""
    return next((spec for spec in MODEL_SPECS if isinstance(model, spec.model_type)), None)


def spec_for_hf_config(config: dict[str, Any], backend: str = "weft") -> ModelSpec:
    """The spec reading a config.json's model_type. backend "weft": weft's family (Llama's, whose
    reader refuses with HFConfigError, for any other); "transformers": transformers' code builds it;
    "auto": weft's family where weft implements the model_type, else transformers'."""
    ours = next((spec for spec in MODEL_SPECS if config.get("model_type") in spec.hf.model_types), None)
    if backend == "transformers" or (backend == "auto" and ours is None):
        return TRANSFORMERS_SPEC
    return ours or LLAMA_SPEC


__all__ = ["ALL_SPECS", "BACKENDS", "MODEL_SPECS", "TRANSFORMERS_SPEC", "Experts", "HFConfigError", "HFMapping", "ModelSpec", "flavors", "builds_flavors", "chosen_backend", "spec_for_args", "spec_for_flavor",
           "spec_for_hf_config", "spec_for_model"]
