"""The data part of the plan: which files a run reads, checked before any process group exists.

`plan_data(cfg, tokenizer, tokenizer_path, resume_folder)` finds the training files of
`data.dataset_path`, or of every source of `data.mixture` (components/data/mixture.py), and the
validation files; checks that each file is readable in its format (the start of each text file,
every record of a JSONL chat or prompt/completion file, a Parquet/Arrow file's footer, a shard
folder's manifest and sizes); and compares them with the fingerprint of the checkpoint the run
resumes from (components/data/fingerprint.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from weft.components.config import ConfigError, JobConfig
from weft.components.data import DataError, HFTokenizer, build_loader, check_text_files, find_text_files
from weft.components.data.fingerprint import check_resumed_data, data_fingerprint
from weft.components.data.mixture import MixtureEntry, parse_mixture
from weft.components.data.shards import (
    are_shards,
    check_shard_format,
    check_tokenizer,
    is_shard_folder,
    read_manifest,
    tokenizer_identity,
)


@dataclass(frozen=True)
class DataSource:
    """One source of data.mixture: its name (in metrics and checkpoints), weight and files, and
    its own validation files (validation.mixture; else none)."""

    name: str
    path: str
    weight: float
    files: list[Path]
    validation_files: list[Path] = field(default_factory=list)


@dataclass
class DataPlan:
    files: list[Path]  # every training file, of every source
    validation_files: list[Path]  # every validation file
    sources: list[DataSource]  # data.mixture's sources; empty for data.dataset_path
    fingerprint: str = ""  # JSON saved with each checkpoint
    note: str | None = None  # resuming over changed data, allowed: a line for the log


def plan_data(cfg: JobConfig, tokenizer, tokenizer_path: str, resume_folder: Path | None) -> DataPlan:
    """The run's data files, checked, and their fingerprint against `resume_folder`'s (None: a fresh run)."""
    sources = mixture_sources(cfg, tokenizer, tokenizer_path)
    if sources:
        files = [path for source in sources for path in source.files]
        current = {f"{source.name}/{name}": value for source in sources
                   for name, value in data_fingerprint(source.files, source.path).items()}
        described = f"data.mixture = {cfg.data.mixture!r}"
    else:
        files = dataset_files(cfg, cfg.data.dataset_path, "data.dataset_path", tokenizer, tokenizer_path)
        current = data_fingerprint(files, cfg.data.dataset_path)
        described = f"data.dataset_path = {cfg.data.dataset_path!r}"
    validation_files = []  # validation.dataset_path's: one loss over them
    if cfg.validation.enable and not any(source.validation_files for source in sources):
        if not cfg.validation.dataset_path:
            raise ConfigError("validation.dataset_path: required when validation.enable is set"
                              + (" (or validation.mixture, one path per source)" if sources else ""))
        validation_files = dataset_files(cfg, cfg.validation.dataset_path, "validation.dataset_path", tokenizer,
                                         tokenizer_path)
    validation_format = cfg.validation.format or cfg.data.format
    training = [(cfg.data.format, source.files) for source in sources] or [(cfg.data.format, files)]
    check_formats(cfg, tokenizer, tokenizer_path, training + [(validation_format, validation_files)]
                  + [(validation_format, source.validation_files) for source in sources])
    fingerprint, note = check_resumed_data(current, described, resume_folder, cfg.data.allow_changed_data)
    every_validation_file = validation_files + [path for source in sources for path in source.validation_files]
    return DataPlan(files, every_validation_file, sources, fingerprint, note)


def mixture_sources(cfg: JobConfig, tokenizer, tokenizer_path: str) -> list[DataSource]:
    """data.mixture's sources with their files and, with validation.mixture, their validation
    files; a UserError naming the entry for a bad weight, path or count."""
    entries, validation_paths = mixture_entries(cfg)
    sources = []
    for text, entry, validation_path in zip(cfg.data.mixture, entries, validation_paths):
        files = dataset_files(cfg, entry.path, f"data.mixture entry {text!r}", tokenizer, tokenizer_path)
        validation = [] if validation_path is None else dataset_files(
            cfg, validation_path, f"validation.mixture entry {validation_path!r}", tokenizer, tokenizer_path)
        sources.append(DataSource(entry.name, entry.path, entry.weight, files, validation))
    return sources


def mixture_entries(cfg: JobConfig) -> tuple[list[MixtureEntry], list[str | None]]:
    """data.mixture's entries and each one's validation path (None: none), checked as written,
    without reading any file (the dry run checks this much); a UserError naming the key."""
    if not cfg.data.mixture:
        if cfg.validation.mixture:
            raise ConfigError("validation.mixture: one validation path per source of data.mixture, which is not set "
                              "(use validation.dataset_path)")
        return [], []
    entries = parse_mixture(cfg.data.mixture)
    if not (cfg.validation.enable and cfg.validation.mixture):
        return entries, [None] * len(entries)
    if len(cfg.validation.mixture) != len(entries):
        raise ConfigError(f"validation.mixture: {len(cfg.validation.mixture)} paths for the {len(entries)} "
                          "sources of data.mixture; expected one per source, in data.mixture's order")
    if cfg.validation.dataset_path:
        raise ConfigError("validation.dataset_path and validation.mixture: set one (validation.mixture gives "
                          "one loss per source)")
    return entries, list(cfg.validation.mixture)


def dataset_files(cfg: JobConfig, dataset_path: str, key: str, tokenizer, tokenizer_path: str) -> list[Path]:
    """The data files at `dataset_path` (find_text_files), or, for a folder of token shards (its manifest.json),
    the shards: checked from the manifest and the shards' sizes, made with the run's tokenizer."""
    if not is_shard_folder(dataset_path):
        return find_text_files(dataset_path, key=key)
    manifest = read_manifest(dataset_path, key=key)
    check_tokenizer(manifest, tokenizer_identity(tokenizer_path, tokenizer), tokenizer_path)
    return manifest.token_files


def check_formats(cfg: JobConfig, tokenizer, tokenizer_path: str, groups: list[tuple[str, list[Path]]]) -> None:
    """Every file of each (format, files) group readable in its format, before anything is
    written: the start of each text file (seconds even for a big corpus), every record of a JSONL
    chat or prompt/completion file, and of a Parquet/Arrow file its footer only (its columns;
    never its data pages)."""
    if any(fmt == "chat" and files for fmt, files in groups) and (
            not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is None):
        raise DataError(f"model.tokenizer_path: '{tokenizer_path}' has no chat template, which "
                        "data.format = 'chat' needs (a Hugging Face folder whose tokenizer_config.json has one)")
    for data_format, files in groups:
        if are_shards(files):  # read_manifest checked them
            check_shard_format(data_format)
        elif files and data_format == "text":
            check_text_files(files, cfg.data.text_field)
        elif files:
            build_loader(data_format, files, tokenizer, seq_len=cfg.training.seq_len, local_batch_size=1,
                         dp_rank=0, dp_world_size=1).check_records()
