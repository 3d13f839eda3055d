"""The dump-folder check: a run may resume in its own folder, never write into another run's."""

import os
from pathlib import Path

from weft.components.config.parser import ConfigError, read_toml, toml_value
from weft.components.config.schema import JobConfig

# Settings that make a run what it is: a dump folder holding a run with other values for these
# belongs to another experiment, and resuming into it would mix the two.
RUN_IDENTITY = ("model.flavor", "model.tokenizer_path", "data.dataset_path", "data.text_field", "data.format",
                "training.seq_len", "training.seed", "fault_tolerance.replica_id")


def check_creatable_folder(folder: Path, setting: str) -> None:
    """Refuse, naming `setting` (the key, or key and value, that chose it), a folder that cannot be
    created or written: a file in its place or above it, or a nearest existing ancestor this process
    may not write in. Creates nothing."""
    for above in (folder, *folder.parents):  # the folder itself, or its nearest existing ancestor
        if above.exists():
            if not above.is_dir():
                what = "is a file" if above == folder else f"is below {above}, a file"
                raise ConfigError(f"{setting}: {folder} {what}; expected a folder")
            if not os.access(above, os.W_OK | os.X_OK):
                raise ConfigError(f"{setting}: {above} is not writable; expected a folder {folder} can be created in")
            return


def check_dump_folder(cfg: JobConfig) -> None:
    """Refuse a dump folder that cannot be created or written, or that already holds a run of
    another configuration."""
    dump = Path(cfg.job.dump_folder)
    check_creatable_folder(dump, "job.dump_folder")
    saved_path = dump / "config.toml"
    if not saved_path.is_file():
        return
    saved = read_toml(saved_path, label=str(saved_path))
    for key in RUN_IDENTITY:
        section, name = key.split(".")
        table = saved.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"job.dump_folder: {saved_path} holds [{section}] as {_spelled(table)}, "
                              f"not a table; it is not a weft run's config")
        default = getattr(getattr(JobConfig(), section), name)  # a key newer than the saved run
        before, now = table.get(name, default), getattr(getattr(cfg, section), name)
        if before != now:
            raise ConfigError(
                f"job.dump_folder: {saved_path} is a run with {key} = {before!r}, this run has {now!r}; "
                f"use another dump folder"
            )


def _spelled(value: object) -> str:
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)
