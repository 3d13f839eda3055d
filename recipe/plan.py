"""The plan of a run: everything the config decides, checked, before any process group or file exists.

`RunPlan.from_config(cfg, world_size)` resolves the model shape, the layout of `world_size`
ranks, the tokenizer, the data and validation files, the precision policy, the batch and the
options of `parallelize`, each transform's built from its config section. It is pure: it reads files
(tokenizer, the start of each data file, a saved config) but creates no process group and writes
nothing, so a bad run fails the same way on every rank, at once, and the dry run plans exactly
what a real start would run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weft.components.checkpoint.checkpointer import check_resume, resume_folder
from weft.components.config import ConfigError, JobConfig, check_dump_folder
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import DataError, load_tokenizer
from weft.components.distributed.flight_recorder import check_trace_folder
from weft.components.distributed.processes import collective_backend, restart_warning
from weft.components.ft.checks import check_fault_tolerance
from weft.components.hf import check_export_folder, model_args_for_run
from weft.components.observe.profiling import check_profiling
from weft.components.observe.wandb_logger import check_wandb
from weft.float8 import Float8Options, float8_tp_all_gather
from weft.models import ModelSpec, spec_for_args
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.lora import LoRAOptions
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, check_composes
from weft.parallelisms.pipeline import PipelineLayout, PipelineOptions, plan_pipeline
from weft.parallelisms.precision import PrecisionPolicy, attention_kernel_warning, precision_policy
from weft.parallelisms.tp import TPOptions
from weft.recipe.checks.experts import check_expert_parallel, check_model_layout
from weft.recipe.checks.gpu import check_cpu_offload, check_gpu_compute, check_shared_gpus, float8_warnings
from weft.recipe.checks.lora import check_lora
from weft.recipe.checks.packed import check_packed_documents
from weft.recipe.config_keys import config_error, model_source, read_options
from weft.recipe.data_plan import DataSource, mixture_entries, plan_data
from weft.recipe.objectives import Objective, objective_class


@dataclass
class RunPlan:
    cfg: JobConfig
    spec: ModelSpec  # the model's family (models/), resolved once from model_args
    model_args: Any
    dims: ParallelDims
    tokenizer: object
    data_files: list[Path]
    validation_files: list[Path]
    precision: PrecisionPolicy
    options: ParallelizeOptions = field(default_factory=ParallelizeOptions)  # parallelize's, from the config
    warnings: list[str] = field(default_factory=list)
    data_fingerprint: str = ""  # JSON saved with each checkpoint (components/data/fingerprint.py)
    data_sources: list[DataSource] = field(default_factory=list)  # data.mixture's (recipe/data_plan.py)
    pipeline: PipelineLayout | None = None  # with parallelism.pp > 1
    objective: type[Objective] | None = None  # what the run trains (recipe/objectives/): from_config sets it

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int, *, device_type: str | None = None,
                    check_environment: bool = True, writes_dump_folder: bool = True) -> RunPlan:
        """Check the config against itself, the files it names and `world_size`; raise a UserError
        (one line naming the key) on the first problem. device_type: where the run will compute
        (default: cuda if this machine has it). check_environment=False (the dry run, which may plan on a
        laptop for a cluster) skips the tokenizer, data, dump folder, checkpoints and float8 support.
        writes_dump_folder=False (a measurement that builds the run but writes no outputs, as the
        benchmarks do) skips what reads job.dump_folder: another run's config there, the export
        folders, the checkpoint to resume and its data fingerprint."""
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        spec, model_args, dims = model_and_layout(cfg, world_size, device_type)
        check_packed_documents(cfg, spec, model_args)
        objective = objective_class(cfg)  # the one choice of what the run trains (recipe/objectives/)
        objective.check(cfg, dims)
        tokenizer, data_files, validation_files, data_sources = None, [], [], []
        fingerprint, notes = "", []
        if check_environment:
            tokenizer = load_tokenizer(tokenizer_path(cfg))
            if tokenizer.vocab_size > model_args.vocab_size:
                raise DataError(f"model.tokenizer_path: the tokenizer's vocabulary ({tokenizer.vocab_size}) is "
                                f"larger than the vocabulary of {model_source(cfg)} ({model_args.vocab_size})")
            resumes = cfg.checkpoint.enable and writes_dump_folder
            if writes_dump_folder:
                check_dump_folder(cfg)  # resuming is fine; reusing another experiment's folder is not
                check_trace_folder(cfg)
                if cfg.export.hf_folder:
                    check_export_folder(Path(cfg.job.dump_folder), cfg.export.hf_folder)
            if resumes:
                check_resume(cfg.checkpoint, Path(cfg.job.dump_folder), cfg.training.steps)
            # the data files, checked, against the fingerprint of the checkpoint this run resumes from
            data = plan_data(cfg, tokenizer, tokenizer_path(cfg),
                             resume_folder(cfg.checkpoint, Path(cfg.job.dump_folder)) if resumes else None)
            data_files, validation_files, data_sources = data.files, data.validation_files, data.sources
            fingerprint = data.fingerprint
            notes = [note for note in (data.note, restart_warning()) if note]
            check_wandb(cfg)  # the package, with metrics.enable_wandb
        else:
            mixture_entries(cfg)  # data.mixture as written (its paths are the real start's to find)
        t = cfg.training
        precision = precision_policy(t.mixed_precision_param, t.mixed_precision_reduce, fsdp=dims.fsdp_enabled,
                                     device_type=device_type)
        check_gpu_compute(cfg, dims, precision, device_type)
        check_cpu_offload(cfg, dims, device_type)
        check_shared_gpus(cfg, dims, device_type)
        check_fault_tolerance(cfg, dims.dp_replicate, device_type, check_environment=check_environment)
        check_profiling(cfg, device_type, check_folders=check_environment and writes_dump_folder)
        warnings = [line for line in [attention_kernel_warning(device_type, precision.compute_dtype,
                                                               model_args.n_heads, model_args.kv_heads)] if line]
        plan = cls(cfg, spec, model_args, dims, tokenizer, data_files, validation_files, precision,
                   options=parallelize_options(cfg, dims, device_type, spec, model_args),
                   warnings=[*warnings, *float8_warnings(cfg, dims, device_type), *notes] if check_environment
                   else warnings,
                   data_fingerprint=fingerprint, data_sources=data_sources,
                   pipeline=pipeline_layout(cfg, model_args, dims), objective=objective)
        check_lora(cfg, spec, model_args, dims, plan.options.lora)
        return plan

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.training
        return self.objective.rows_per_sample * t.seq_len * t.local_batch_size * t.gradient_accumulation_steps * self.dims.dp


def model_and_layout(cfg: JobConfig, world_size: int, device_type: str) -> tuple[ModelSpec, Any, ParallelDims]:
    """The model's spec and shape and the layout of `world_size` ranks, checked against each other
    (`check_layout`; ConfigError / LayoutError, one line)."""
    args = model_args_for_run(cfg.model.flavor, cfg.checkpoint.initial_load_path, cfg.model.backend,
                              cfg.model.trust_remote_code)
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {cfg.training.seq_len} exceeds the maximum {args.max_seq_len} "
                          f"of {model_source(cfg)}")
    p = cfg.parallelism
    dims = ParallelDims.resolve(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                                world_size=world_size, ep=p.ep)
    spec = spec_for_args(args)
    check_layout(cfg, spec, args, dims, device_type)
    return spec, args, dims


def check_layout(cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims, device_type: str) -> None:
    """Whether the model of `args` (of family `spec`) trains in layout `dims` with the config's transforms on
    `device_type`; if not, a ConfigError or LayoutError (one line naming the key) saying why: the
    sequence split, the model's family, expert parallelism, the transforms' composition, the
    pipeline."""
    dims.check_seq_len(cfg.training.seq_len)
    check_model_layout(cfg, spec, args, dims)
    check_expert_parallel(cfg, spec, args, dims)
    try:
        check_composes(parallelize_options(cfg, dims, device_type), dims.tp)
    except TransformError as e:
        raise config_error(cfg, e) from None
    pipeline_layout(cfg, args, dims)


def pipeline_layout(cfg: JobConfig, args: Any, dims: ParallelDims) -> PipelineLayout | None:
    """The pipeline's schedule, stages and micro-batches, checked against the model and batch."""
    if not dims.pp_enabled:
        return None
    p = cfg.parallelism
    return plan_pipeline(schedule=p.pp_schedule, pp=dims.pp, stages_per_rank_requested=p.pp_stages_per_rank,
                         microbatches=p.pp_microbatches, local_batch_size=cfg.training.local_batch_size,
                         n_blocks=args.n_layers, tied_embeddings=args.tie_embeddings,
                         model=model_source(cfg))


def parallelize_options(cfg: JobConfig, dims: ParallelDims, device_type: str, spec: ModelSpec | None = None,
                        model_args: Any = None) -> ParallelizeOptions:
    """parallelize()'s options, each transform's from its config section (`read_options`); with
    `spec` and `model_args`, float8's filter in that model's module names (`float8_filter`)."""
    p, f8 = cfg.parallelism, cfg.float8
    all_gather = (f8.enable and dims.world_size > 1 and
                  float8_tp_all_gather(device_type, collective_backend(device_type, share_gpus=p.share_gpus), f8.recipe))
    return ParallelizeOptions(
        lora=read_options(cfg, LoRAOptions) if cfg.lora.enable else None,
        float8=read_options(cfg, Float8Options, filter_fqns=float8_filter(cfg, spec, model_args)) if f8.enable else None,
        tp=read_options(cfg, TPOptions, float8_all_gather=bool(all_gather)),
        ac=read_options(cfg, ACOptions),
        compile=read_options(cfg, CompileOptions) if cfg.compile.enable else None,
        fsdp=read_options(cfg, FSDPOptions),
        pipeline=read_options(cfg, PipelineOptions) if dims.pp_enabled else None,
    )


def float8_filter(cfg: JobConfig, spec: ModelSpec | None, model_args: Any) -> tuple[str, ...]:
    """float8.filter_fqns, its entry "output" (weft's output head) naming the model's own output
    projection too (a transformers model's `lm_head`), so that the default keeps the head in high
    precision on either backend."""
    entries = tuple(cfg.float8.filter_fqns)
    if "output" in entries and model_args is not None:
        head = spec.hf_of(model_args).tied_output.removesuffix(".weight")
        entries += (head,) if head not in entries else ()
    return entries


def tokenizer_path(cfg: JobConfig) -> str:
    """model.tokenizer_path, or by default the tokenizer of an initial Hugging Face folder, else
    the shipped Shakespeare tokenizer."""
    if cfg.model.tokenizer_path:
        return cfg.model.tokenizer_path
    initial = Path(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None
    if initial is not None and (initial / "tokenizer.json").is_file():
        return str(initial)
    return str(SHIPPED_TOKENIZER)


