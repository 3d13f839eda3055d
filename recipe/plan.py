"""The plan of a run: everything the config decides, checked, before any process group or file exists.

`RunPlan.from_config(cfg, world_size)` resolves the model shape, the layout of `world_size`
ranks, the tokenizer, the data and validation files, the precision policy, the batch and the
options of `parallelize`, each transform's built from its config section. It is pure: it reads files
(tokenizer, the start of each data file, a saved config) but creates no process group and writes
nothing, so a bad run fails the same way on every rank, at once, and the dry run plans exactly
what a real start would run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import torch
from torch import nn

from weft.components.checkpoint.checkpointer import check_resume, resume_folder
from weft.components.config import FROM_HF_CONFIG, ConfigError, JobConfig, check_dump_folder
from weft.components.config.shipped import SHIPPED_TOKENIZER
from weft.components.data import DataError, load_tokenizer
from weft.components.distributed.flight_recorder import check_trace_folder
from weft.components.distributed.processes import collective_backend, launched_world_size, restart_warning
from weft.components.ft.checks import check_fault_tolerance
from weft.components.hf import check_export_folder, model_args_for_run
from weft.components.hf.writer import ExportError, check_peft_export
from weft.components.observe.profiling import check_profiling
from weft.components.observe.wandb_logger import check_wandb
from weft.float8 import Float8Options, check_float8_compute, check_float8_support, float8_tp_all_gather
from weft.models import spec_for_args
from weft.models.transformers.spec import expert_adapters_refusal, uncommon_attention
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.lora import LoRAOptions, apply_lora, check_nf4_shape, lora_modules, names_routed_experts
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, check_composes
from weft.parallelisms.pipeline import PipelineLayout, PipelineOptions, plan_pipeline
from weft.parallelisms.precision import DTYPES, PrecisionPolicy, attention_kernel_warning, precision_policy
from weft.parallelisms.tp import TPOptions, check_tp_plan
from weft.recipe.data_plan import DataSource, mixture_entries, plan_data
from weft.recipe.objectives import Objective, objective_class


@dataclass
class RunPlan:
    cfg: JobConfig
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
        model_args, dims = model_and_layout(cfg, world_size, device_type)
        check_packed_documents(cfg, model_args)
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
        if cfg.parallelism.fsdp_cpu_offload and not dims.fsdp_enabled:
            raise ConfigError(f"parallelism.fsdp_cpu_offload: offloads FSDP's shards, and this layout "
                              f"({dims.describe()}) has no FSDP (dp_shard x cp = 1)")
        if cfg.parallelism.fsdp_cpu_offload and device_type != "cuda":  # FSDP pins the shards it offloads
            raise ConfigError("parallelism.fsdp_cpu_offload: moves GPU memory to the CPU, and this run has no GPU")
        check_shared_gpus(cfg, dims, device_type)
        check_fault_tolerance(cfg, dims.dp_replicate, device_type, check_environment=check_environment)
        check_profiling(cfg, device_type, check_folders=check_environment and writes_dump_folder)
        warnings = [line for line in [attention_kernel_warning(device_type, precision.compute_dtype,
                                                               model_args.n_heads, model_args.kv_heads)] if line]
        plan = cls(cfg, model_args, dims, tokenizer, data_files, validation_files, precision,
                   options=parallelize_options(cfg, dims, device_type, model_args),
                   warnings=[*warnings, *float8_warnings(cfg, dims, device_type), *notes] if check_environment
                   else warnings,
                   data_fingerprint=fingerprint, data_sources=data_sources,
                   pipeline=pipeline_layout(cfg, model_args, dims), objective=objective)
        check_lora(plan)
        return plan

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.training
        return self.objective.rows_per_sample * t.seq_len * t.local_batch_size * t.gradient_accumulation_steps * self.dims.dp


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
    return ConfigError(f"{_setting(cfg, key)}: {error.conflict.label} ({_setting(cfg, other)}) {error.reason}")


def _setting(cfg: JobConfig, key: str) -> str:
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


def model_and_layout(cfg: JobConfig, world_size: int, device_type: str) -> tuple[Any, ParallelDims]:
    """The flavor's shape and the layout of `world_size` ranks, checked against each other
    (`check_layout`; ConfigError / LayoutError, one line)."""
    args = model_args_for_run(cfg.model.flavor, cfg.checkpoint.initial_load_path, cfg.model.backend,
                              cfg.model.trust_remote_code)
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {cfg.training.seq_len} exceeds the maximum {args.max_seq_len} "
                          f"of {model_source(cfg)}")
    p = cfg.parallelism
    dims = ParallelDims.resolve(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                                world_size=world_size, ep=p.ep)
    check_layout(cfg, args, dims, device_type)
    return args, dims


def check_layout(cfg: JobConfig, args: Any, dims: ParallelDims, device_type: str) -> None:
    """Whether the model of `args` trains in layout `dims` with the config's transforms on
    `device_type`; if not, a ConfigError or LayoutError (one line naming the key) saying why: the
    sequence split, the model's family, expert parallelism, the transforms' composition, the
    pipeline."""
    dims.check_seq_len(cfg.training.seq_len)
    check_model_support(cfg, args, dims)
    check_backend(cfg, args, dims)
    check_expert_parallel(cfg, args, dims)
    try:
        check_composes(parallelize_options(cfg, dims, device_type), dims.tp)
    except TransformError as e:
        raise config_error(cfg, e) from None
    pipeline_layout(cfg, args, dims)


def check_backend(cfg: JobConfig, args, dims: ParallelDims) -> None:
    """What the transformers backend (models/transformers) does not reach, refused in one line naming
    the key: context parallelism and pipeline stages of a model whose attention is not plain causal
    (sliding windows, sinks, linear attention: `uncommon_attention`), context parallelism of packed
    rows (`check_backend_cp`); expert parallelism of experts other than plain SwiGLU ones; tensor
    parallelism of a model that declares no plan (`_tp_plan`) or one apply_tp cannot translate;
    weft's MoE balancing (routing bias, load-balancing loss), which transformers' routers do not take.
    compile.enable (each decoder layer compiled) and float8.enable (transformers' nn.Linear layers,
    the head kept by float8_filter) go through as for weft's models."""
    if spec_for_args(args).backend != "transformers":
        return
    built = f"{args.architecture} (model_type {args.model_type}, built by transformers)"
    if dims.cp > 1:
        check_backend_cp(cfg, args, built, dims.cp)
    if dims.pp > 1 and (what := uncommon_attention(args)) is not None:
        raise ConfigError(f"parallelism.pp = {dims.pp}: {built}: {what}, and its pipeline stage "
                          "(parallelisms/hf_stages.py) gives every layer one plain causal mask; set parallelism.pp = 1")
    refuse_ep = spec_for_args(args).expert_parallel_refusal
    if dims.ep > 1 and refuse_ep is not None and (refusal := refuse_ep(args)) is not None:
        raise ConfigError(f"parallelism.ep = {dims.ep}: {built}: {refusal}, and expert parallelism spreads weft's "
                          "grouped experts, which compute plain SwiGLU experts; set parallelism.ep = 1")
    if cfg.lora.enable and names_routed_experts(cfg.lora.target_modules):
        check_backend_expert_lora(cfg, args, built, dims)
    for key, value in (("moe.bias_update_rate", cfg.moe.bias_update_rate),
                       ("moe.load_balance_coeff", cfg.moe.load_balance_coeff)):
        if value:
            raise ConfigError(f"{key} = {value}: {built} routes by transformers' own arithmetic, which weft's "
                              "balancing (a routing bias, a load-balancing loss) does not reach; set it to 0")
    if dims.tp > 1 and not args.declares_tp_plan:
        raise ConfigError(f"parallelism.tp = {dims.tp}: {built} declares no "
                          "tensor-parallel plan (_tp_plan); set parallelism.tp = 1")
    split_experts = dims.tp > 1 and spec_for_args(args).experts(args) is not None  # by expert (parallelisms/tp.py)
    if split_experts and dims.ep > 1:
        raise ConfigError(f"parallelism.tp = {dims.tp} with parallelism.ep = {dims.ep}: {built} keeps every token on "
                          "each tp rank (no sequence parallelism), and tensor parallelism splits its experts by expert "
                          "itself; set parallelism.ep = 1 or parallelism.tp = 1")
    if split_experts and cfg.compile.enable:
        raise ConfigError(f"compile.enable = true with parallelism.tp = {dims.tp}: {built} splits its experts by "
                          "expert, each rank's share of the tokens cut on the host, which compile cannot trace; set "
                          "compile.enable = false")
    if dims.tp > 1 and (refusal := tp_plan_refusal(args, dims.tp)) is not None:
        raise ConfigError(f"parallelism.tp = {dims.tp}: {refusal}")


def check_backend_expert_lora(cfg: JobConfig, args, built: str, dims: ParallelDims) -> None:
    """LoRA on a transformers model's routed experts: the adapters go on weft's experts in
    transformers' place (`prepare_experts`), so only where those compute the family's experts, and
    not yet under tensor parallelism (its plan for the stacked experts splits no adapters)."""
    key = f"lora.target_modules = {list(cfg.lora.target_modules)}"
    if (refusal := expert_adapters_refusal(args)) is not None:
        raise ConfigError(f"{key}: {built}: {refusal}, and adapters of routed experts go on weft's experts in "
                          "their place, which compute plain SwiGLU experts and gpt-oss's; target its linears")
    if dims.tp > 1:
        raise ConfigError(f"{key}: adapters of {built}'s routed experts are not split by tensor parallelism yet; "
                          "set parallelism.tp = 1 (parallelism.ep spreads them) or target its linears")


def prepare_experts(args, model: nn.Module, *, ep: int = 1, tp: int = 1, lora: LoRAOptions | None = None) -> None:
    """Swap weft's grouped experts in for a transformers model's routed experts where a run needs
    them (models/transformers/experts.py): expert parallelism spreads them, tensor parallelism splits
    them by expert, and LoRA's adapters of routed experts go on them. Before `parallelize`, on the
    meta model."""
    prepare = spec_for_args(args).prepare_expert_parallel
    adapted = lora is not None and names_routed_experts(lora.target_modules)
    if prepare is not None and (ep > 1 or tp > 1 or adapted):
        prepare(model)


def check_backend_cp(cfg: JobConfig, args, built: str, cp: int) -> None:
    """Context parallelism of a transformers model: its attention layers dispatch to weft's core
    (parallelisms/cp.py), which is plain causal over the sequence's global positions, so the model
    must have only plain causal attention and the rows no packed documents (which that core would
    let see each other)."""
    what = uncommon_attention(args)
    if what is None and args.config.get("attn_logit_softcapping"):
        what = "its attention caps its logits (attn_logit_softcapping)"
    if what is not None:
        raise ConfigError(f"parallelism.cp = {cp}: {built}: {what}, and the context-parallel core computes plain "
                          "causal attention over the whole sequence; set parallelism.cp = 1")
    formats = {"data.format": cfg.data.format, "validation.format": cfg.validation.format or cfg.data.format}
    for key, value in formats.items():
        if value in ("chat", "prompt_completion") and (key == "data.format" or cfg.validation.enable):
            raise ConfigError(f"parallelism.cp = {cp}: {key} = {value} packs samples into rows, and the "
                              f"context-parallel core of {built} does not keep them apart; train it on "
                              "data.format = text without data.document_masking, or set parallelism.cp = 1")
    if cfg.data.document_masking:
        raise ConfigError(f"parallelism.cp = {cp}: data.document_masking = true: the context-parallel core of {built} "
                          "does not keep packed documents apart; set it to false, or set parallelism.cp = 1")


def check_packed_documents(cfg: JobConfig, args) -> None:
    """Documents packed into one row (chat and prompt/completion samples, text with document masking,
    and their validation) must not see each other: refused, naming the key, for a model whose spec says
    they would (transformers' gpt-oss, linear-attention models)."""
    refuse = spec_for_args(args).packed_documents_refusal
    if refuse is None or (refusal := refuse(args)) is None:
        return
    formats = {"data.format": cfg.data.format, "validation.format": cfg.validation.format or cfg.data.format}
    for key, value in formats.items():
        if value in ("chat", "prompt_completion") and (key == "data.format" or cfg.validation.enable):
            raise ConfigError(f"{key} = {value}: packs samples into rows, and {refusal}; "
                              "train it on data.format = text without data.document_masking")
    if cfg.data.document_masking:
        raise ConfigError(f"data.document_masking = true: {refusal}; set it to false")


@functools.lru_cache(maxsize=8)
def tp_plan_refusal(args, tp: int) -> str | None:
    """Why apply_tp cannot split a transformers model over tp ranks by the plan it declares (a style
    it does not translate, experts or heads tp does not divide), from the model on meta as the
    recipe builds it; None where it can."""
    spec = spec_for_args(args)
    with torch.device("meta"):
        model = spec.build(args)
    prepare_experts(args, model, tp=tp)
    try:
        check_tp_plan(model, tp)
    except TransformError as e:
        return str(e)
    return None


def check_model_support(cfg: JobConfig, args, dims: ParallelDims) -> None:
    """Refuse, in one line, what the model's family cannot be trained in: QLoRA where its spec says
    NF4 cannot hold its base (Llama 4: torchao's NF4 holds 2-D weights only, so the stacked routed
    experts, most of the model, would stay unquantized)."""
    spec = spec_for_args(args)
    refusal = spec.nf4_refusal_for(args)
    if cfg.lora.enable and cfg.lora.quantize_base and refusal is not None:
        raise ConfigError(f"lora.quantize_base = {cfg.lora.quantize_base!r}: {model_source(cfg)} ({spec.name}) "
                          f"{refusal}; use LoRA (lora.quantize_base = '')")


def check_expert_parallel(cfg: JobConfig, args, dims: ParallelDims) -> None:
    """Expert parallelism needs experts to spread, as many on each rank, and (so far) no
    dp_replicate: one line naming the key otherwise (the ranks it borrows: ParallelDims)."""
    if dims.ep == 1:
        return
    experts = spec_for_args(args).experts(args)
    if experts is None:
        raise ConfigError(f"parallelism.ep = {dims.ep}: {model_source(cfg)} has no experts to spread; set parallelism.ep = 1")
    if experts.n_experts % dims.ep:
        raise ConfigError(f"parallelism.ep = {dims.ep} does not divide the {experts.n_experts} experts of {model_source(cfg)}; "
                          "each rank holds as many experts as the others")
    if dims.dp_replicate > 1:
        raise ConfigError(f"parallelism.ep = {dims.ep}: expert parallelism composes with dp_shard, cp, tp and pp so "
                          f"far, not parallelism.dp_replicate = {dims.dp_replicate}")
    if cfg.compile.enable:
        raise ConfigError(f"parallelism.ep = {dims.ep}: the all-to-all's split sizes are read on the host, which "
                          "compile cannot trace; set compile.enable = false")


def pipeline_layout(cfg: JobConfig, args: Any, dims: ParallelDims) -> PipelineLayout | None:
    """The pipeline's schedule, stages and micro-batches, checked against the model and batch."""
    if not dims.pp_enabled:
        return None
    p = cfg.parallelism
    return plan_pipeline(schedule=p.pp_schedule, pp=dims.pp, stages_per_rank_requested=p.pp_stages_per_rank,
                         microbatches=p.pp_microbatches, local_batch_size=cfg.training.local_batch_size,
                         n_blocks=args.n_layers, tied_embeddings=args.tie_embeddings,
                         model=model_source(cfg))


def parallelize_options(cfg: JobConfig, dims: ParallelDims, device_type: str,
                        model_args: Any = None) -> ParallelizeOptions:
    """parallelize()'s options, each transform's from its config section (`read_options`); with
    `model_args`, float8's filter in that model's module names (`float8_filter`)."""
    p, f8 = cfg.parallelism, cfg.float8
    all_gather = (f8.enable and dims.world_size > 1 and
                  float8_tp_all_gather(device_type, collective_backend(device_type, share_gpus=p.share_gpus), f8.recipe))
    return ParallelizeOptions(
        lora=read_options(cfg, LoRAOptions) if cfg.lora.enable else None,
        float8=read_options(cfg, Float8Options, filter_fqns=float8_filter(cfg, model_args)) if f8.enable else None,
        tp=read_options(cfg, TPOptions, float8_all_gather=bool(all_gather)),
        ac=read_options(cfg, ACOptions),
        compile=read_options(cfg, CompileOptions) if cfg.compile.enable else None,
        fsdp=read_options(cfg, FSDPOptions),
        pipeline=read_options(cfg, PipelineOptions) if dims.pp_enabled else None,
    )


def float8_filter(cfg: JobConfig, model_args: Any) -> tuple[str, ...]:
    """float8.filter_fqns, its entry "output" (weft's output head) naming a transformers model's head
    (`lm_head`) too, so that the default keeps the head in high precision on either backend."""
    entries = tuple(cfg.float8.filter_fqns)
    if "output" in entries and model_args is not None and spec_for_args(model_args).backend == "transformers":
        head = spec_for_args(model_args).hf_of(model_args).tied_output.removesuffix(".weight")
        entries += (head,) if head not in entries else ()
    return entries


def check_lora(plan: RunPlan) -> None:
    """LoRA against the model (targets, NF4 shapes and FSDP shards), on a meta-device model: every
    refusal before anything is built, one line naming the key."""
    lora, dims = plan.options.lora, plan.dims
    if lora is None:
        if plan.cfg.export.peft_folder:
            raise ConfigError("export.peft_folder: writes LoRA adapters; set lora.enable")
        return
    peft = Path(plan.cfg.job.dump_folder) / plan.cfg.export.peft_folder
    if plan.cfg.export.peft_folder and peft.exists():
        raise ConfigError(f"export.peft_folder: {peft} exists; refusing to overwrite it")
    if plan.cfg.checkpoint.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint: a LoRA run's adapters start from PEFT's initialisation "
                          "and its base is read from checkpoint.initial_load_path; seed the base in a run without "
                          "lora.enable and give its step-0 as checkpoint.initial_load_path")
    with torch.device("meta"):
        model = spec_for_args(plan.model_args).build(plan.model_args)
    prepare_experts(plan.model_args, model, lora=lora)
    try:
        apply_lora(model, lora)
        spec = spec_for_args(plan.model_args)
        if plan.cfg.export.peft_folder and spec.peft_refusal is not None:
            refusal = spec.peft_refusal(plan.model_args, [name for name, _ in lora_modules(model)])
            if refusal is not None:
                raise ConfigError(f"export.peft_folder = {plan.cfg.export.peft_folder!r}: {refusal}")
        if plan.cfg.export.peft_folder:
            try:
                check_peft_export(model)
            except ExportError as e:
                raise ConfigError(f"export.peft_folder = {plan.cfg.export.peft_folder!r}: {e}") from None
        shards = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
        for name, module in lora_modules(model) if lora.quantize_base else []:
            check_nf4_shape(name, module.weight.shape, shards)
    except TransformError as e:
        raise config_error(plan.cfg, e) from None


def tokenizer_path(cfg: JobConfig) -> str:
    """model.tokenizer_path, or by default the tokenizer of an initial Hugging Face folder, else
    the shipped Shakespeare tokenizer."""
    if cfg.model.tokenizer_path:
        return cfg.model.tokenizer_path
    initial = Path(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None
    if initial is not None and (initial / "tokenizer.json").is_file():
        return str(initial)
    return str(SHIPPED_TOKENIZER)


def float8_warnings(cfg: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """What float8 support on this device and backend says (warnings), or a ConfigError."""
    f8 = cfg.float8
    if not f8.enable:
        return []
    try:
        return check_float8_support(
            device_type,
            run_backend(cfg, device_type) if dims.world_size > 1 else None,
            recipe=f8.recipe,
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
            precompute_float8_dynamic_scale_for_fsdp=f8.precompute_float8_dynamic_scale_for_fsdp,
            tp_degree=dims.tp,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run_backend(cfg: JobConfig, device_type: str) -> str:
    """The collective backend string this run's process group gets (components.distributed)."""
    p = cfg.parallelism
    return collective_backend(device_type, share_gpus=p.share_gpus, cpu_offload=p.fsdp_cpu_offload)


def check_gpu_compute(cfg: JobConfig, dims: ParallelDims, precision: PrecisionPolicy, device_type: str) -> None:
    """What the GPU's kernels need of the configured shapes and dtypes (float8's `_scaled_mm`),
    checked for the dry run's planned device too: a ConfigError, one line."""
    t, f8 = cfg.training, cfg.float8
    if not f8.enable:
        return
    try:
        check_float8_compute(device_type, f8.recipe, precision.compute_dtype, t.local_batch_size * t.seq_len // dims.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_shared_gpus(cfg: JobConfig, dims: ParallelDims, device_type: str) -> None:
    """Ranks sharing a GPU talk through gloo, which moves CUDA tensors well enough for FSDP and DDP
    but crashes under TP, CP and PP (all-gathers into one tensor, point-to-point sends: SIGSEGV,
    `writev Bad address`, `Pair is not connected` with torch 2.11 on an H100): a ConfigError."""
    if not cfg.parallelism.share_gpus or device_type != "cuda":
        return
    sizes = {"parallelism.tp": dims.tp, "parallelism.cp": dims.cp, "parallelism.pp": dims.pp}
    if bad := [f"{key} = {size}" for key, size in sizes.items() if size > 1]:
        raise ConfigError(f"parallelism.share_gpus: ranks sharing a GPU use gloo, which cannot all-gather CUDA "
                          f"tensors into one or send them point to point (crashes seen with torch 2.11 on an "
                          f"H100); use it with FSDP or DDP only, not {', '.join(bad)}")


def check_launch(cfg: JobConfig) -> int:
    """The world size this process is part of (job.simulate_world_size, else torchrun's), after
    refusing what a simulated or seed-checkpoint run cannot do."""
    simulated, launched = cfg.job.simulate_world_size, launched_world_size()
    if simulated and launched > 1:
        raise ConfigError(f"job.simulate_world_size: simulates {simulated} ranks in one process; "
                          f"run it as python train.py, not {launched} processes")
    if simulated and (cfg.checkpoint.enable or cfg.checkpoint.initial_load_path):
        raise ConfigError("job.simulate_world_size: checkpoints need real ranks (a fake rank would save or load "
                          "garbage); set checkpoint.enable = false and checkpoint.initial_load_path = ''")
    world_size = simulated or launched
    if cfg.checkpoint.create_seed_checkpoint and world_size > 1:
        raise ConfigError("checkpoint.create_seed_checkpoint: run it as one process (python train.py), "
                          f"not {world_size}")
    return world_size
