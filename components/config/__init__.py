"""weft's configuration: the schema (schema.py), how it is read (parser.py), the dump-folder check."""

from weft.components.config.dump_folder import RUN_IDENTITY, check_creatable_folder, check_dump_folder
from weft.components.config.parser import ConfigError, help_text, parse_args, to_dict, to_toml
from weft.components.config.schema import (
    FROM_HF_CONFIG,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Data,
    Export,
    FaultTolerance,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Sampling,
    Training,
    Validation,
)

__all__ = [
    "RUN_IDENTITY", "check_creatable_folder", "check_dump_folder", "ConfigError", "help_text", "parse_args", "to_dict", "to_toml",
    "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "Data", "Export", "FaultTolerance", "FROM_HF_CONFIG", "Float8", "JobConfig",
    "Job", "LRScheduler",
    "Metrics", "Model", "Optimizer", "Parallelism", "Profiling", "Sampling", "Training", "Validation",
]
