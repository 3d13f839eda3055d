"""Reading the configuration: command line > TOML file > dataclass defaults (components/config/schema.py).

``parse_args`` merges the three layers, checks every value against its field's constraints and
raises ConfigError naming the key, the value and what was expected; ``help_text`` is --help;
``to_toml`` writes a config that ``parse_args`` reads back equal:

    python train.py --job.config_file llama3_8b --training.steps 100 --no-metrics.enable_tensorboard
"""

import difflib
import math
import operator
import sys
from dataclasses import Field, asdict, fields
from pathlib import Path
from typing import Any

from weft.components.config.schema import MAX_MICRO_BATCH_TOKENS, JobConfig
from weft.components.config.shipped import TRAIN_CONFIGS, shipped_path
from weft.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# Bare config names given to --job.config_file are looked up here.
TRAIN_CONFIGS_DIR = TRAIN_CONFIGS
# Paths that may name a shipped asset (`assets/...`): found in weft's package when not in the current folder.
_ASSET_PATHS = ("model.tokenizer_path", "data.dataset_path", "validation.dataset_path")


class ConfigError(UserError):
    """A bad configuration; the message is one line naming the key, the value and what was expected."""


# Every option as "section.key" -> its field, in declaration order.
_OPTIONS: dict[str, Field] = {f"{s.name}.{f.name}": f for s in fields(JobConfig) for f in fields(s.type)}
_SECTIONS = tuple(s.name for s in fields(JobConfig))
_EXPECTED = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list[str]: "a list of strings",
             list[float]: "a list of numbers"}
_METAVAR = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR", list[str]: "A,B,...", list[float]: "X,Y,..."}
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
    if typ == list[float]:
        return [float(item) for item in text.split(",") if item.strip()]
    return text


def _from_toml(value: Any, typ: Any) -> Any:
    """Check a TOML value against ``typ`` (bools are not numbers); raises ValueError if it does not fit."""
    if typ is float and type(value) in (int, float):
        return float(value)
    if typ == list[str] and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    if typ == list[float] and isinstance(value, list) and all(type(item) in (int, float) for item in value):
        return [float(item) for item in value]
    if type(value) is typ:
        return value
    raise ValueError(value)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr spells floats, inf and nan the way TOML does
    if isinstance(value, str):
        escaped = (_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in value)
        return '"' + "".join(escaped) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _show(value: Any, origin: str | None) -> str:
    """``value`` spelled the way its origin spells it: Python for the command line and defaults, else TOML."""
    if origin in (_CLI, None):
        return repr(value)
    try:
        return toml_value(value)
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


def read_toml(path: Path, label: str | None = None) -> dict[str, Any]:
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


def _closest_choice(value: str, choices) -> str | None:
    """The choice nearest `value`, ignoring case ("1f1bb" -> "1F1B"; a prefix of one choice, "zbv" ->
    "ZBVZeroBubble"), or None."""
    by_lower = {str(c).lower(): str(c) for c in choices}
    if value and len(starts := [c for low, c in by_lower.items() if low.startswith(value.lower())]) == 1:
        return starts[0]
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.5)
    return by_lower[close[0]] if close else None


def _validate(cfg: JobConfig, origins: dict[str, str]) -> None:
    """Check every value against its field's constraints."""
    for name, f in _OPTIONS.items():
        section, key = name.split(".")
        value, meta, origin = getattr(getattr(cfg, section), key), f.metadata, origins.get(name)
        where, got = _where(name, origin), _show(value, origin)
        if meta["choices"] is not None and value not in meta["choices"]:
            hint = f" (did you mean {close}?)" if (close := _closest_choice(str(value), meta["choices"])) else ""
            shown = ", ".join(str(c) or "''" for c in meta["choices"])
            raise ConfigError(f"{where}: expected one of {shown}; got {got}{hint}")
        if (rule := value_rule(f, value)) is not None:
            raise ConfigError(f"{where}: {rule}, got {got}")


def value_rule(f: Field, value: Any) -> str | None:
    """What a value of field `f` must be ("must be >= 1") when `value` breaks one of its bounds or
    its check (finite floats, 64-bit integers), else None."""
    meta = f.metadata
    if f.type is float and not math.isfinite(value):  # nan compares false with every bound
        return "must be a finite number"
    if f.type is int and not _INT64_MIN <= value <= _INT64_MAX:
        return "must fit in 64 bits"
    for bound, symbol, holds in _BOUNDS:
        if meta[bound] is not None and not holds(value, meta[bound]):
            return f"must be {symbol} {meta[bound]}"
    if meta["check"] is not None and not meta["check"][0](value):
        return f"must be {meta['check'][1]}"
    return None


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
        _apply_toml(cfg, read_toml(path), path.name, origins)
    for name, value in overrides:
        _set(cfg, name, value)
        origins[name] = _CLI
    for name in _ASSET_PATHS:
        section, key = name.split(".")
        _set(cfg, name, shipped_path(getattr(getattr(cfg, section), key)))
    _validate(cfg, origins)
    _validate_combinations(cfg, origins)
    return cfg


def _validate_combinations(cfg: JobConfig, origins: dict[str, str]) -> None:
    """Values that are fine alone but not together."""
    ckpt, training = cfg.checkpoint, cfg.training
    if ckpt.load_step >= 0 and not ckpt.enable:
        where = _where("checkpoint.load_step", origins.get("checkpoint.load_step"))
        raise ConfigError(f"{where} = {ckpt.load_step} needs --checkpoint.enable; without it no checkpoint is loaded")
    _check_disabled_sections(cfg, origins)
    tokens = training.local_batch_size * training.seq_len
    if tokens > MAX_MICRO_BATCH_TOKENS:
        where = _where("training.local_batch_size", origins.get("training.local_batch_size"))
        raise ConfigError(
            f"{where}: {training.local_batch_size} samples x seq_len {training.seq_len} = {tokens:,} tokens per "
            f"device and micro-batch, more than {MAX_MICRO_BATCH_TOKENS:,}; lower it (gradient_accumulation_steps "
            f"grows the batch without the memory)")


def _check_disabled_sections(cfg: JobConfig, origins: dict[str, str]) -> None:
    """One rule for every section with an `enable` switch: a key of that section set to anything
    but its default while the switch is off by default (set nowhere) would be silently ignored, so
    it is an error naming the key and the switch. A switch turned off explicitly (in the TOML file or
    on the command line) keeps its section's keys dormant; keys marked `without_enable` act on
    their own and are exempt."""
    defaults = JobConfig()
    for name, f in _OPTIONS.items():
        section, key = name.split(".")
        switch = f"{section}.enable"
        if key == "enable" or switch not in _OPTIONS or switch in origins or getattr(getattr(cfg, section), "enable"):
            continue
        value = getattr(getattr(cfg, section), key)
        if f.metadata["without_enable"] or value == getattr(getattr(defaults, section), key):
            continue
        origin = origins.get(name)
        raise ConfigError(f"{_where(name, origin)} = {_show(value, origin)} has no effect while {switch} is false; "
                          f"set {switch} = true (--{switch}), or drop {name}")


def to_dict(cfg: JobConfig) -> dict[str, dict[str, object]]:
    """``{section: {key: value}}``, for logging and saving."""
    return asdict(cfg)


def to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that ``parse_args`` reads back to an equal config."""
    blocks = (
        "\n".join([f"[{section}]"] + [f"{key} = {toml_value(value)}" for key, value in values.items()])
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
            detail = f"default {toml_value(default)}" + (f"; {constraints}" if constraints else "")
            lines += [f"  --{section}.{key} {_METAVAR[option.type]}  ({detail})", f"      {option.metadata['help']}"]
    return "\n".join(lines)
