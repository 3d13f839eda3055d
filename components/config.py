"""Typed job configuration: command line > TOML file > dataclass defaults.

Each TOML section is a dataclass; each field carries a one-line help string and
optional constraints in its metadata. ``parse_args`` merges the three layers and
validates every value before training starts:

    python train.py --job.config_file llama3_8b --training.steps 100 --no-metrics.enable_tensorboard
"""

import difflib
import math
import operator
import os
import sys
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

__all__ = ["ConfigError", "JobConfig", "MODEL_FLAVORS", "help_text", "parse_args", "to_dict", "to_toml"]

# Bare config names given to --job.config_file are looked up here.
TRAIN_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "train_configs"

# Kept in sync with models.llama.LLAMA_FLAVORS (checked by a test there).
MODEL_FLAVORS = (
    "debugmodel", "llama2_7b", "llama2_13b", "llama2_70b",
    "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b", "llama3_405b",
)


class ConfigError(ValueError):
    """A bad configuration; the message is one line naming the key, the value and what was expected."""


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    check: tuple[Callable[[Any], bool], str] | None = None,
) -> Any:
    """A dataclass field with help and constraints; ``check`` is (predicate, "what it must be")."""
    metadata = {"help": help, "choices": choices, "min": min, "max": max, "gt": gt, "lt": lt, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _is_op_or_positive_int(value: str) -> bool:
    return value == "op" or (value.isdecimal() and int(value) > 0)


# A path or name that must not be empty: "" would mean the current folder (train on every text
# file under it, or write outputs into it), which no one means.
_NOT_EMPTY = (lambda value: value.strip() != "", "a non-empty path or name")

# Tokens one device holds in one micro-batch (local_batch_size x seq_len). 2**24 is far beyond
# what any model's activations fit in; a larger value is a typo that would otherwise allocate
# for minutes before failing.
MAX_MICRO_BATCH_TOKENS = 2**24


@dataclass
class Job:
    config_file: str = opt("", "TOML file: a path, or a bare name found in train_configs/ ('.toml' optional)")
    dump_folder: str = opt("./outputs", "Folder for every output of the run: logs, TensorBoard (tb/), checkpoints",
                           check=_NOT_EMPTY)
    description: str = opt("", "Free text shown in the startup summary")
    simulate_world_size: int = opt(
        0, "Run rank 0 of a job of this many ranks in this one process, collectives faked: its memory and step "
           "time are real, its losses meaningless (0: off)", min=0)
    dry_run: bool = opt(
        False, "Plan the run in one process without devices: build every transform on the meta device, print the "
               "layout, parameters per rank and a per-device memory estimate, write nothing")
    dry_run_world_size: int = opt(
        0, "World size the dry run plans for (0: job.simulate_world_size if set, else the product of the "
           "parallelism degrees, dp_shard -1 counting as 1)",
        min=0)
    dry_run_device_memory_gib: str = opt(
        "", "Device memory the dry run checks the estimate against: GiB ('80') or a GPU name ('h100', 'a100-40gb', "
            "'4090'); exit 2 if it does not fit ('': no check)")


@dataclass
class Model:
    flavor: str = opt("debugmodel", "Model architecture and size", choices=MODEL_FLAVORS)
    tokenizer_path: str = opt(
        "", "SentencePiece .model file or Hugging Face tokenizer folder; empty: the folder of "
        "checkpoint.initial_load_path if it has a tokenizer.json, else assets/tokenizer/shakespeare.model")


@dataclass
class Training:
    steps: int = opt(1000, "Number of optimizer steps to train", min=1)
    seq_len: int = opt(2048, "Tokens per training sample", min=1)
    local_batch_size: int = opt(8, "Samples per data-parallel rank per micro-step", min=1)
    gradient_accumulation_steps: int = opt(1, "Micro-steps accumulated per optimizer step", min=1)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm; 0 disables clipping", min=0)
    seed: int = opt(0, "Random seed for weight initialization and data order", min=0, max=2**63 - 1)
    deterministic: bool = opt(False, "Use deterministic algorithms (reproducible, slower)")
    mixed_precision_param: str = opt(
        "bfloat16", "Dtype FSDP computes parameters in", choices=("float32", "bfloat16"))
    mixed_precision_reduce: str = opt(
        "float32", "Dtype FSDP reduces gradients in", choices=("float32", "bfloat16"))


@dataclass
class Parallelism:
    dp_replicate: int = opt(1, "Data-parallel replicas (DDP, or the outer dimension of HSDP)", min=1)
    dp_shard: int = opt(
        -1, "FSDP shard degree; -1 takes what the other degrees leave of the world",
        check=(lambda v: v == -1 or v >= 1, "-1 or >= 1"))
    cp: int = opt(1, "Context-parallel degree", min=1)
    tp: int = opt(1, "Tensor-parallel degree", min=1)
    fsdp_reshard_after_forward: str = opt(
        "default", "When FSDP frees gathered parameters after forward", choices=("default", "always", "never"))
    fsdp_cpu_offload: bool = opt(False, "Keep sharded parameters, gradients and optimizer state in CPU memory")
    loss_parallel: bool = opt(True, "With tp > 1, compute the loss on vocabulary-sharded logits")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer", choices=("AdamW",))
    lr: float = opt(3e-4, "Peak learning rate", gt=0)
    beta1: float = opt(0.9, "Decay rate of the first-moment estimate", min=0, lt=1)
    beta2: float = opt(0.95, "Decay rate of the second-moment estimate", min=0, lt=1)
    eps: float = opt(1e-8, "Term added to the denominator for numerical stability", gt=0)
    weight_decay: float = opt(0.1, "Decoupled weight decay coefficient", min=0)
    implementation: str = opt(
        "auto", "Optimizer kernel implementation", choices=("auto", "foreach", "fused", "for-loop"))


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from 0 to the peak learning rate", min=0)
    decay_type: str = opt("linear", "Shape of the decay after warmup", choices=("linear", "cosine"))
    min_lr_ratio: float = opt(0.0, "Final learning rate as a fraction of the peak", min=0, max=1)


@dataclass
class Data:
    dataset_path: str = opt("assets/data/shakespeare", "A .txt or .jsonl file, or a folder of them", check=_NOT_EMPTY)
    text_field: str = opt("text", "Field of each JSONL record that holds the text", check=_NOT_EMPTY)
    format: str = opt(
        "text", "text: packed raw text, every token supervised; chat: JSONL {messages: [{role, content}]}, loss on "
        "assistant turns; prompt_completion: JSONL {prompt, completion} (or instruction/input/output), loss on the "
        "completion", choices=("text", "chat", "prompt_completion"))
    document_masking: bool = opt(
        False, "format text: attention stays within each document and positions restart at each BOS "
        "(chat and prompt_completion samples are always masked this way)")
    long_samples: str = opt(
        "truncate", "Chat / prompt_completion samples longer than seq_len + 1 tokens: cut to fit, or skip; "
        "either is counted in the log", choices=("truncate", "drop"))


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate the loss on a held-out dataset during training")
    dataset_path: str = opt("", "A .txt or .jsonl file, or a folder of them, read in data.format unless "
                            "validation.format is set")
    format: str = opt("", "Format of the validation data; empty: data.format",
                      choices=("", "text", "chat", "prompt_completion"))
    freq: int = opt(100, "Evaluate every N steps (and after the last step)", min=1)
    steps: int = opt(10, "Global batches (as in training, accumulation included) evaluated each time: always the first ones of the dataset", min=1)


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every N steps", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard scalars under <dump_folder>/tb/")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the latest one")
    interval: int = opt(500, "Save a checkpoint every N steps", min=1)
    keep_latest_k: int = opt(0, "Keep only the newest K checkpoints; 0 keeps all", min=0)
    async_mode: str = opt("disabled", "Save in the background while training continues", choices=("disabled", "async"))
    load_step: int = opt(-1, "Step to resume from; -1 loads the latest complete checkpoint", min=-1)
    folder: str = opt("checkpoint", "Checkpoint folder, relative to dump_folder", check=_NOT_EMPTY)
    initial_load_path: str = opt(
        "", "Weights to start from when dump_folder has no checkpoint: a DCP checkpoint folder or a Hugging Face folder")
    create_seed_checkpoint: bool = opt(
        False, "Only initialise the model on one process and save it as step-0, the seed every layout can start from")


@dataclass
class Float8:
    enable: bool = opt(False, "Train linear layers with float8 matmuls")
    recipe: str = opt("tensorwise", "Float8 scaling granularity", choices=("tensorwise", "rowwise"))
    enable_fsdp_float8_all_gather: bool = opt(False, "All-gather FSDP parameters in float8 to halve traffic")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute float8 scales for all FSDP parameters in one fused step after each optimizer step")
    filter_fqns: list[str] = opt(["output"], "Module names kept in high precision")
    min_dim: int = opt(1024, "Keep linear layers with a dimension below this in high precision (too small to gain)",
                       min=16)


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block and the loss")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations in backward to save memory", choices=("none", "full", "selective"))
    selective_option: str = opt(
        "op", "'op' saves matmul outputs and recomputes the rest; a positive N checkpoints every N-th block",
        check=(_is_op_or_positive_int, "'op' or a positive integer"))


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    float8: Float8 = field(default_factory=Float8)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)


# Every option as "section.key" -> its field, in declaration order.
_OPTIONS: dict[str, Field] = {f"{s.name}.{f.name}": f for s in fields(JobConfig) for f in fields(s.type)}
_SECTIONS = tuple(s.name for s in fields(JobConfig))
_EXPECTED = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list[str]: "a list of strings"}
_METAVAR = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR", list[str]: "A,B,..."}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_BOUNDS = (("min", ">=", operator.ge), ("gt", ">", operator.gt), ("max", "<=", operator.le), ("lt", "<", operator.lt))
_CLI = "<command line>"  # origin of command-line values; TOML values record their file name
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # every integer ends up in a tensor, an RNG seed or a C loop


# ---- values: conversion, display, TOML writing ----

def _from_text(text: str, typ: Any) -> Any:
    """Convert a command-line string to ``typ``; raises ValueError if it does not fit."""
    if typ is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(text)
    if typ is int or typ is float:
        return typ(text)
    if typ == list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def _from_toml(value: Any, typ: Any) -> Any:
    """Check a TOML value against ``typ`` (bools are not numbers); raises ValueError if it does not fit."""
    if typ is float and type(value) in (int, float):
        return float(value)
    if typ == list[str] and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    if type(value) is typ:
        return value
    raise ValueError(value)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr spells floats, inf and nan the way TOML does
    if isinstance(value, str):
        escaped = (_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value)
        return '"' + "".join(escaped) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _show(value: Any, origin: str | None) -> str:
    """``value`` spelled the way its origin spells it: Python for the command line and defaults, else TOML."""
    if origin in (_CLI, None):
        return repr(value)
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)


def _where(name: str, origin: str | None) -> str:
    if origin == _CLI:
        return f"--{name}"
    return f"{name} (default)" if origin is None else f"{name} in {origin}"


def _closest_option(name: str) -> str | None:
    """The option most likely meant by an unknown ``section.key``: the same key elsewhere, else a near spelling."""
    key = name.rpartition(".")[2]
    moved = [option for option in _OPTIONS if option.endswith("." + key)]
    return (moved or difflib.get_close_matches(name, _OPTIONS, n=1) or [None])[0]


def _set(cfg: JobConfig, name: str, value: Any) -> None:
    section, key = name.split(".")
    setattr(getattr(cfg, section), key, value)


# ---- the three layers ----

def _parse_command_line(argv: list[str]) -> list[tuple[str, Any]]:
    """Typed ``(section.key, value)`` pairs from the command line, in order."""
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        token, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}; options look like --section.key value")
        name, has_value, text = token[2:].partition("=")
        negated = name.startswith("no-") and name[3:] in _OPTIONS
        name = name[3:] if negated else name
        if name not in _OPTIONS:
            match = _closest_option(name)
            hint = f"; did you mean --{match}?" if match else "; run with --help to list options"
            raise ConfigError(f"unknown option {token.partition('=')[0]}{hint}")
        typ = _OPTIONS[name].type
        if negated:
            if typ is not bool:
                raise ConfigError(f"--no-{name}: only boolean options have a --no- form")
            if has_value:
                raise ConfigError(f"--no-{name}: takes no value, got {text!r}")
            text = "false"
        elif not has_value and typ is bool:
            text = "true"
            if following is not None and following.lower() in _TRUE + _FALSE:  # --flag false
                text, i = following, i + 1
        elif not has_value:
            if following is None or following.startswith("--"):
                raise ConfigError(f"--{name}: missing value, expected {_EXPECTED[typ]}")
            text, i = following, i + 1
        try:
            overrides.append((name, _from_text(text, typ)))
        except ValueError:
            raise ConfigError(f"--{name}: expected {_EXPECTED[typ]}, got {text!r}") from None
    return overrides


def _resolve_config_file(name: str) -> Path:
    """``name`` if it is a file, else ``train_configs/<name>[.toml]``."""
    if Path(name).is_file():
        return Path(name)
    candidate = TRAIN_CONFIGS_DIR / (name if name.endswith(".toml") else name + ".toml")
    if candidate.is_file():
        return candidate
    raise ConfigError(
        f"job.config_file: {name!r} not found (looked in the current folder and {TRAIN_CONFIGS_DIR})")


def _read_toml(path: Path, label: str | None = None) -> dict[str, Any]:
    """The TOML file at `path`; errors name it as `label` (default: its file name)."""
    label = label or path.name
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: invalid TOML: {' '.join(str(e).splitlines())}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 text; e.g. a binary file given by mistake
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{label}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          f"is it a TOML file?") from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read {path}: {e.strerror}") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], file: str, origins: dict[str, str]) -> None:
    for section, table in data.items():
        if section not in _SECTIONS:
            match = difflib.get_close_matches(section, _SECTIONS, n=1)
            hint = f"; did you mean [{match[0]}]?" if match else ""
            raise ConfigError(f"unknown section [{section}] in {file}{hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {file}: expected a [{section}] table, got {_show(table, file)}")
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in _OPTIONS:
                match = _closest_option(name)
                raise ConfigError(f"unknown key {name} in {file}" + (f"; did you mean {match}?" if match else ""))
            typ = _OPTIONS[name].type
            try:
                _set(cfg, name, _from_toml(value, typ))
            except ValueError:
                raise ConfigError(f"{name} in {file}: expected {_EXPECTED[typ]}, "
                                  f"got {_show(value, file)} ({type(value).__name__})") from None
            origins[name] = file


def _validate(cfg: JobConfig, origins: dict[str, str]) -> None:
    """Check every value against its field's constraints."""
    for name, f in _OPTIONS.items():
        section, key = name.split(".")
        value, meta, origin = getattr(getattr(cfg, section), key), f.metadata, origins.get(name)
        where, got = _where(name, origin), _show(value, origin)
        if f.type is float and not math.isfinite(value):  # nan compares false with every bound
            raise ConfigError(f"{where}: must be a finite number, got {got}")
        if f.type is int and not _INT64_MIN <= value <= _INT64_MAX:
            raise ConfigError(f"{where}: must fit in 64 bits, got {got}")
        if meta["choices"] is not None and value not in meta["choices"]:
            raise ConfigError(f"{where}: expected one of {', '.join(meta['choices'])}; got {got}")
        for bound, symbol, holds in _BOUNDS:
            if meta[bound] is not None and not holds(value, meta[bound]):
                raise ConfigError(f"{where}: must be {symbol} {meta[bound]}, got {got}")
        if meta["check"] is not None and not meta["check"][0](value):
            raise ConfigError(f"{where}: must be {meta['check'][1]}, got {got}")


# ---- public API ----

def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build and validate the config from defaults, the TOML file, then ``argv`` (without the program name)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if "--help" in args or "-h" in args:
        print(help_text())
        raise SystemExit(0)
    overrides = _parse_command_line(args)
    cfg = JobConfig()
    origins: dict[str, str] = {}
    config_file = next((v for name, v in reversed(overrides) if name == "job.config_file"), cfg.job.config_file)
    if config_file:
        path = _resolve_config_file(config_file)
        _apply_toml(cfg, _read_toml(path), path.name, origins)
    for name, value in overrides:
        _set(cfg, name, value)
        origins[name] = _CLI
    _validate(cfg, origins)
    _validate_combinations(cfg, origins)
    return cfg


def _validate_combinations(cfg: JobConfig, origins: dict[str, str]) -> None:
    """Values that are fine alone but not together."""
    ckpt, training = cfg.checkpoint, cfg.training
    if ckpt.load_step >= 0 and not ckpt.enable:
        where = _where("checkpoint.load_step", origins.get("checkpoint.load_step"))
        raise ConfigError(f"{where} = {ckpt.load_step} needs --checkpoint.enable; without it no checkpoint is loaded")
    tokens = training.local_batch_size * training.seq_len
    if tokens > MAX_MICRO_BATCH_TOKENS:
        where = _where("training.local_batch_size", origins.get("training.local_batch_size"))
        raise ConfigError(
            f"{where}: {training.local_batch_size} samples x seq_len {training.seq_len} = {tokens:,} tokens per "
            f"device and micro-batch, more than {MAX_MICRO_BATCH_TOKENS:,}; lower it (gradient_accumulation_steps "
            f"grows the batch without the memory)")


# Settings that make a run what it is: a dump folder holding a run with other values for these
# belongs to another experiment, and resuming into it would mix the two.
RUN_IDENTITY = ("model.flavor", "model.tokenizer_path", "data.dataset_path", "data.text_field", "data.format",
                "training.seq_len", "training.seed")


def check_dump_folder(cfg: JobConfig) -> None:
    """Refuse a dump folder that cannot be created or written, or that already holds a run of
    another configuration."""
    dump = Path(cfg.job.dump_folder)
    for above in (dump, *dump.parents):  # the folder itself, or its nearest existing ancestor
        if above.exists():
            if not above.is_dir():
                what = "is a file" if above == dump else f"is below {above}, a file"
                raise ConfigError(f"job.dump_folder: {dump} {what}; expected a folder")
            if not os.access(above, os.W_OK | os.X_OK):
                raise ConfigError(f"job.dump_folder: {above} is not writable")
            break
    saved_path = dump / "config.toml"
    if not saved_path.is_file():
        return
    saved = _read_toml(saved_path, label=str(saved_path))
    for key in RUN_IDENTITY:
        section, name = key.split(".")
        table = saved.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"job.dump_folder: {saved_path} holds [{section}] as {_toml_value_or_repr(table)}, "
                              f"not a table; it is not a weft run's config")
        default = getattr(getattr(JobConfig(), section), name)  # a key newer than the saved run
        before, now = table.get(name, default), getattr(getattr(cfg, section), name)
        if before != now:
            raise ConfigError(
                f"job.dump_folder: {saved_path} is a run with {key} = {before!r}, this run has {now!r}; "
                f"use another dump folder"
            )


def _toml_value_or_repr(value: Any) -> str:
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)


def to_dict(cfg: JobConfig) -> dict[str, dict[str, object]]:
    """``{section: {key: value}}``, for logging and saving."""
    return asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that ``parse_args`` reads back to an equal config."""
    blocks = (
        "\n".join([f"[{section}]"] + [f"{key} = {_toml_value(value)}" for key, value in values.items()])
        for section, values in to_dict(cfg).items()
    )
    return "\n\n".join(blocks) + "\n"


def _constraints(meta: Any) -> str:
    parts = [f"one of {', '.join(meta['choices'])}"] if meta["choices"] else []
    parts += [f"{symbol} {meta[bound]}" for bound, symbol, _ in _BOUNDS if meta[bound] is not None]
    parts += [meta["check"][1]] if meta["check"] else []
    return ", ".join(parts)


def help_text() -> str:
    """The option reference that ``--help`` prints."""
    defaults = to_dict(JobConfig())
    lines = [
        "usage: [--section.key VALUE | --section.key=VALUE | --section.flag | --no-section.flag] ...",
        "",
        "Values come from the command line, else the TOML file named by --job.config_file, else the defaults.",
        "Booleans: --s.flag, --no-s.flag, --s.flag=false or --s.flag false. Lists: comma-separated.",
    ]
    for section in _SECTIONS:
        lines += ["", f"[{section}]"]
        for key, default in defaults[section].items():
            option = _OPTIONS[f"{section}.{key}"]
            constraints = _constraints(option.metadata)
            detail = f"default {_toml_value(default)}" + (f"; {constraints}" if constraints else "")
            lines += [f"  --{section}.{key} {_METAVAR[option.type]}  ({detail})", f"      {option.metadata['help']}"]
    return "\n".join(lines)
