"""The config keys behind parallelize's options and a transform's refusals: each options class
read from its config section field by field (`read_options`), and a TransformError turned into
a ConfigError naming the key and value the user wrote (`config_error`)."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import torch

from weft.components.config import FROM_HF_CONFIG, ConfigError, JobConfig
from weft.float8 import Float8Options
from weft.generation import SamplingParams
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.lora import LoRAOptions
from weft.parallelisms.pipeline import PipelineOptions
from weft.parallelisms.precision import DTYPES
from weft.parallelisms.tp import TPOptions

# Where parallelize's options come from: the config section whose keys are each options class's field
# names (`lora.rank` is LoRAOptions.rank).
OPTION_SECTIONS = {
    LoRAOptions: "lora",
    Float8Options: "float8",
    TPOptions: "parallelism",
    ACOptions: "activation_checkpoint",
    CompileOptions: "compile",
    FSDPOptions: "parallelism",
    PipelineOptions: "parallelism",
}
# The exceptions: fields read from a key of another name or section, and fields no key sets (left at
# their default or computed by `parallelize_options`; a refusal of theirs names the key given).
KEYS_ELSEWHERE = {
    (LoRAOptions, "base_dtype"): "training.mixed_precision_param",  # the frozen base in the compute dtype
    (FSDPOptions, "param_dtype"): "training.mixed_precision_param",
    (FSDPOptions, "reduce_dtype"): "training.mixed_precision_reduce",
    (FSDPOptions, "reshard_after_forward"): "parallelism.fsdp_reshard_after_forward",
    (FSDPOptions, "cpu_offload"): "parallelism.fsdp_cpu_offload",
    (PipelineOptions, "schedule"): "parallelism.pp_schedule",
}
NOT_READ = {
    (TPOptions, "plan"): "parallelism.tp",  # the model's own
    (TPOptions, "float8_all_gather"): "float8.enable",  # and whether this device and backend can
    (CompileOptions, "backend"): "compile.enable",
    (CompileOptions, "fullgraph"): "compile.enable",
    (FSDPOptions, "cast_forward_inputs"): "training.mixed_precision_param",  # the dtype it would cast to
}
# The config key behind the other arguments a refusal may name: the model and layout the transforms
# act on, and parallelize's options as a whole; by function, the key that turns a transform on (for a
# refusal of the transform as a whole, argument None).
LAYOUT_KEYS = {"model": "model.flavor", "tp_mesh": "parallelism.tp", "cp_mesh": "parallelism.cp",
               "ep_mesh": "parallelism.ep", "pipeline": "parallelism.pp", "compile": "compile.enable"}
TRANSFORM_KEYS = {"apply_lora": "lora.enable", "apply_float8": "float8.enable", "apply_tp": "parallelism.tp",
                  "apply_cp": "parallelism.cp", "apply_ep": "parallelism.ep", "apply_compile": "compile.enable",
                  "apply_ac": "activation_checkpoint.mode"}


def option_key(options: type, name: str) -> str:
    """The config key of field `name` of an options class of OPTION_SECTIONS."""
    if (options, name) in NOT_READ:
        return NOT_READ[options, name]
    return KEYS_ELSEWHERE.get((options, name), f"{OPTION_SECTIONS[options]}.{name}")


# The config key behind each argument a transform may name in a refusal: every option's field, the layout.
ARGUMENT_KEYS = {**{f.name: option_key(options, f.name) for options in OPTION_SECTIONS for f in fields(options)},
                 **LAYOUT_KEYS}


def read_options(cfg: JobConfig, options: type, **computed) -> Any:
    """An `options` class of OPTION_SECTIONS read from the config field by field, but for the
    `computed` values: a dtype from its name, a tuple from a list where the field holds tuples, None
    for an empty value where None is the field's default."""
    hints = get_type_hints(options)
    values = {}
    for f in fields(options):
        if f.name in computed or (options, f.name) in NOT_READ:
            continue
        value = config_value(cfg, option_key(options, f.name))
        if torch.dtype in (hints[f.name], *get_args(hints[f.name])):
            value = DTYPES[value]
        elif get_origin(hints[f.name]) is tuple:
            value = tuple(value)
        elif f.default is None and not value:
            value = None
        values[f.name] = value
    return options(**values, **computed)


def config_key(function: str, argument: str | None) -> str | None:
    """The config key behind a transform's argument (None: the transform as a whole)."""
    return TRANSFORM_KEYS.get(function) if argument is None else ARGUMENT_KEYS.get(argument)


def config_error(cfg: JobConfig, error: TransformError) -> ConfigError:
    """A transform's refusal as a config error naming the key and value behind the argument it
    refused: `parallelism.tp = 3: apply_tp: tp_mesh size 3 does not divide n_heads 8`; a refusal
    to compose names both settings: `parallelism.tp = 2: QLoRA (lora.quantize_base = nf4) does not
    support tensor parallelism`."""
    key = config_key(error.function, error.argument)
    if key is None:
        return ConfigError(str(error))
    if error.conflict is None:
        return ConfigError(f"{key} = {config_value(cfg, key)}: {error}")
    other = config_key(error.conflict.function, error.conflict.argument)
    return ConfigError(f"{setting(cfg, key)}: {error.conflict.label} ({setting(cfg, other)}) {error.reason}")


def setting(cfg: JobConfig, key: str) -> str:
    """`key = value`, or the key alone for a switch that is on (`float8.enable`)."""
    value = config_value(cfg, key)
    return key if value is True else f"{key} = {value}"


def config_value(cfg: JobConfig, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def model_source(cfg: JobConfig) -> str:
    """Where the model's shape comes from, for messages: its flavor, or the Hugging Face config.json."""
    if cfg.model.flavor == FROM_HF_CONFIG:
        return f"the model of {Path(cfg.checkpoint.initial_load_path) / 'config.json'}"
    return f"model flavor {cfg.model.flavor}"


def sampling_params(cfg: JobConfig) -> SamplingParams:
    """The [sampling] section as the generation engine's SamplingParams (its stop strings a tuple)."""
    return SamplingParams(**{**asdict(cfg.sampling), "stop": tuple(cfg.sampling.stop)})
