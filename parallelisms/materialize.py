"""Materialise a (possibly parallelised) meta-device model and initialise its weights."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from weft.layers.init import param_seed
from weft.parallelisms.lora import init_lora_adapters

InitFn = Callable[[nn.Module], None]


def materialize(
    model: nn.Module,
    device: torch.device | str,
    *,
    seed: int = 0,
    init: str | InitFn | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Allocate the model's parameters and buffers on `device`, then initialise them.

    cpu_offload: parameters on the CPU (FSDP's offloading copies them per all-gather), buffers on
    `device`. init None: the model's `init_weights(seed=...)`, else "hf" for a transformers model, else
    "reset_parameters"; "hf" runs its `_init_weights(module)` module by module; a function is called
    as `init(module)` on every module. Each parameter is filled whole, then each rank keeps its slice,
    and module-by-module modes seed from (seed, module name): the weights equal a single device's.
    LoRA adapters are then reset as PEFT does (A kaiming-uniform, B zero). Apply after all transforms.
    """
    shared = _shared_parameters(model)
    parameter_device, buffer_device = materialize_devices(device, cpu_offload)
    model.to_empty(device=parameter_device)
    _retie(model, shared)
    if buffer_device != parameter_device:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device=buffer_device)
    if init is None:
        init = _default_init(model)
    with implicit_replication():
        if init == "init_weights":
            model.init_weights(seed=seed)
        else:
            _init_module_by_module(model, parameter_device, seed, _module_init_fn(model, init))
        init_lora_adapters(model, seed)  # the model's init filled them as plain linears
    return model


def materialize_for_loading(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device model whose weights a checkpoint fills next, filling what no checkpoint
    holds as the model does: where it initialises itself (weft's `init_weights`), its buffers alone
    (`names=()`: the rotary table, an MoE's balancing state), nothing drawn for weights about to be
    overwritten; any other (a transformers model, whose `_init_weights` sets its buffers module by
    module) `materialize`d whole, as in training. Tied parameters stay tied."""
    if _default_init(model) != "init_weights":
        return materialize(model, device)
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    _retie(model, shared)
    model.init_weights(names=())
    return model


def materialize_part(model: nn.Module, module_names: Sequence[str], device: torch.device | str, *,
                     seed: int = 0) -> None:
    """`materialize` for the named submodules of a meta-device `model` only (and the model's own
    buffers), giving them the values `materialize` would: each parameter seeded by its full name,
    adapters as PEFT initialises them. To stream a model through a transform a part at a time
    (QLoRA's start-up: materialise, load, quantize, next). Not for tied parameters."""
    device = torch.device(device)
    parts = {name: model.get_submodule(name) for name in module_names}
    for module in [model, *parts.values()]:
        for holder in (module.modules() if module is not model else [model]):
            for key, buffer in holder._buffers.items():
                if buffer is not None and buffer.is_meta:
                    holder._buffers[key] = torch.empty_like(buffer, device=device)
    for part in parts.values():
        part.to_empty(device=device)
    names = {f"{prefix}.{n}" for prefix, part in parts.items() for n, _ in part.named_parameters()}
    init = _default_init(model)
    with torch.no_grad(), implicit_replication():  # experts spread by EP take their slice of the full draw
        if init == "init_weights":
            model.init_weights(seed=seed, names=names)
        else:
            init_fn = _module_init_fn(model, init)
            for prefix, part in parts.items():
                _init_module_by_module(part, device, seed, init_fn, prefix=prefix)
        for prefix, part in parts.items():
            init_lora_adapters(part, seed, prefix)


def materialize_devices(device: torch.device | str, cpu_offload: bool) -> tuple[torch.device, torch.device]:
    """(where parameters go, where buffers go): both on `device`, except that FSDP's CPU offloading
    keeps parameters on the CPU ("FSDP parameters should be materialized on CPU when enabling CPU
    offloading", at the first forward otherwise)."""
    device = torch.device(device)
    return (torch.device("cpu") if cpu_offload else device), device


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered under more than one (module, name), e.g. tied embeddings:
    the places of each, in registration order."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [where for where in places.values() if len(where) > 1]


def _retie(model: nn.Module, shared: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group of places share one parameter again.

    `to_empty` allocates each module's parameters separately, so a parameter registered twice
    (the output projection tied to the token embedding) comes back as two independent tensors:
    the model would train two matrices and save values its tied export contradicts. The first
    place's new parameter is put in the other places."""
    for (first, first_name), *others in shared:
        param = first._parameters[first_name]
        for module, name in others:
            module._parameters[name] = param


def _default_init(model: nn.Module) -> str:
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights) and "seed" in inspect.signature(init_weights).parameters:
        return "init_weights"
    if callable(getattr(model, "_init_weights", None)) and hasattr(model, "config"):
        return "hf"
    return "reset_parameters"


def _module_init_fn(model: nn.Module, init: str | InitFn) -> InitFn:
    if callable(init):
        return init
    if init == "hf":
        if not callable(getattr(model, "_init_weights", None)):
            raise ValueError(f"materialize: init='hf' needs a transformers model; {type(model).__name__} has no _init_weights")
        return model._init_weights
    if init == "reset_parameters":
        return _reset_parameters
    raise ValueError(f"materialize: init must be None, 'init_weights', 'hf', 'reset_parameters' or a function, got {init!r}")


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    elif any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"materialize: {type(module).__name__} has parameters of its own but no reset_parameters(); "
            "pass init=<function(module)>"
        )


@torch.no_grad()
def _init_module_by_module(model: nn.Module, device: torch.device, seed: int, init_fn: InitFn,
                           prefix: str = "") -> None:
    """Run init_fn on each module with full-size stand-ins for its (possibly sharded) parameters,
    under a generator seeded by (seed, module name), then copy each rank's slice in. prefix: the
    name of `model` within a larger model, whose names seed it."""
    devices = [device] if device.type == "cuda" else []
    for name, module in model.named_modules(prefix=prefix):
        params = dict(module.named_parameters(recurse=False))
        full = {n: torch.empty(p.shape, dtype=p.dtype, device=device) for n, p in params.items()}
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(param_seed(seed, name))
            for n, tensor in full.items():
                module._parameters[n] = nn.Parameter(tensor, requires_grad=params[n].requires_grad)
            try:
                init_fn(module)
            finally:
                module._parameters.update(params)
        for n, param in params.items():
            param.copy_(full[n] if isinstance(param, DTensor) else full[n].to(param.device))
