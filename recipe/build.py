"""Building a run from its plan: processes and meshes, the model, the data, the optimizer, the step.

Each function takes the plan (recipe/plan.py) and what the functions before it built, so
train.py, the dry run and the benchmarks assemble the same pieces the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from weft.components.checkpoint.checkpointer import Checkpointer, CheckpointError, load_model_weights
from weft.components.checkpoint.state import whole_model
from weft.components.data import build_loader, prefetch
from weft.components.data.fingerprint import FINGERPRINT_FILE
from weft.components.data.mixture import Mixture
from weft.components.distributed.flight_recorder import PhaseRecord, start_flight_recorder, trace_files_note
from weft.components.distributed.processes import (
    gpu_binding_line,
    init_distributed,
    local_world_size,
    set_determinism,
    simulation_warning,
)
from weft.components.distributed.timeouts import CommTimeouts, set_collective_timeout
from weft.components.ft.checks import describe_groups
from weft.components.ft.diloco import DiLoCoGroups
from weft.components.ft.groups import NoFaultTolerance, ReplicaGroups, training_state
from weft.components.hf import load_hf_into_model
from weft.components.observe.log import setup_logging
from weft.components.observe.metrics import (
    MetricsLogger,
    active_parameters,
    count_parameters,
    flops_per_token,
)
from weft.components.observe.wandb_logger import WandbLogger
from weft.components.training.moe_balance import reset_expert_counts, set_load_balance_loss
from weft.components.training.nonfinite import NonFinitePolicy
from weft.components.training.optim import build_lr_scheduler, build_optimizer
from weft.parallelisms.common import TransformError
from weft.parallelisms.lora import quantize_lora_base
from weft.parallelisms.materialize import materialize, materialize_part
from weft.parallelisms.parallel_dims import Meshes
from weft.parallelisms.parallelize import parallelize
from weft.parallelisms.pipeline import PipelineStages, build_schedule, default_split, pipeline_units, split_model
from weft.recipe.checks.experts import prepare_experts
from weft.recipe.config_keys import config_error
from weft.recipe.plan import RunPlan
from weft.recipe.step import PipelineLoss, PipelineStep, StepSetup, model_forward
from weft.recipe.summary import global_batch_line

logger = logging.getLogger("weft")


@dataclass
class Trainer:
    """The model, its optimizer and schedule, and how each step runs (`step`, for recipe/step.py's
    train_step): what `build_trainer` returns."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: StepSetup


@dataclass
class Training(Trainer):
    """What a training loop needs, built in the one order: processes and meshes, data, then the
    trainer (model, optimizer and schedule, and how each step runs)."""

    device: torch.device
    meshes: Meshes | None
    rank: int
    loader: object  # yields Batch; close() stops its background thread
    # A fresh validation loader per evaluation, by source name ('' for validation.dataset_path):
    # one loss each. Empty: no validation.
    validation_loaders: dict[str, Callable[[], object]]


def build_training(plan: RunPlan) -> Training:
    """Start the processes, then build data, model, optimizer and step from the plan, in that order."""
    device, meshes, rank = start_processes(plan)
    loader, validation_loaders = build_data(plan, meshes, device)
    t = build_trainer(plan, meshes, device)
    return Training(model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, step=t.step, device=device,
                    meshes=meshes, rank=rank, loader=loader, validation_loaders=validation_loaders)


def build_trainer(plan: RunPlan, meshes: Meshes | None, device: torch.device) -> Trainer:
    """The model, its optimizer and schedule, and the step setup, for processes already started
    (or none, in one process): what a benchmark feeding its own batches needs."""
    model = build_model(plan, meshes, device)
    optimizer, scheduler = build_optimizer_and_schedule(plan, model)
    step = build_step(plan, model, optimizer, scheduler, meshes, device)
    step.objective = plan.objective.build(plan, step, meshes, device)  # its extra models too (a reference)
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler, step=step)


def start_processes(plan: RunPlan) -> tuple[torch.device, Meshes | None, int]:
    """The process group, this rank's device, the meshes (None for one process) and the rank;
    logging and random state set up. With job.simulate_world_size this one process is rank 0 of
    that many, collectives faked."""
    cfg, dims, p = plan.cfg, plan.dims, plan.cfg.parallelism
    start_flight_recorder(cfg)  # [comm] trace_buf_size: torch reads its environment as the group starts
    device = init_distributed(timeout_s=cfg.comm.init_timeout_seconds, simulate_world_size=cfg.job.simulate_world_size,
                              share_gpus=p.share_gpus,
                              cpu_offload=p.fsdp_cpu_offload)
    if cfg.checkpoint.create_seed_checkpoint:  # the whole fp32 model (70B: 280 GB) fits host memory, not a GPU
        device = torch.device("cpu")
    meshes = dims.build_mesh(device.type) if dims.world_size > 1 else None
    set_collective_timeout(cfg.comm.init_timeout_seconds)  # the mesh's groups too, while loading
    rank = torch.distributed.get_rank() if meshes else 0
    setup_logging(rank)
    if cfg.job.simulate_world_size:
        logger.warning(simulation_warning(dims.world_size))
    binding = gpu_binding_line(local_world_size(), torch.cuda.device_count(), p.share_gpus) if device.type == "cuda" else None
    if binding and rank == 0:
        logger.warning(binding)
    for line in plan.warnings if rank == 0 else []:
        logger.warning(line)
    set_determinism(cfg.training.seed, cfg.training.deterministic)
    backend = f", collectives {torch.distributed.get_backend()}" if meshes and not cfg.job.simulate_world_size else ""
    logger.info(f"devices: {dims.world_size} x {device.type}{backend}; mesh {dims.describe()}")
    return device, meshes, rank


def build_model(plan: RunPlan, meshes: Meshes | None, device: torch.device | None) -> nn.Module:
    """The model built on the meta device (shapes without memory, so any size fits), transformed by
    `parallelize` in its one order, then materialised on `device` (None: left on meta, as the dry
    run wants it). Each parameter is drawn whole and every rank keeps its slice, so the weights
    equal a single-device run's with the same seed, whatever the layout."""
    spec = plan.spec
    with torch.device("meta"):
        model = spec.build(plan.model_args)
    prepare_experts(spec, model, ep=plan.dims.ep, tp=plan.dims.tp, lora=plan.options.lora)
    if plan.pipeline is not None:  # this rank's stages, each parallelised and materialised as a model
        return build_stages(plan, model, meshes, device)
    qlora = plan.options.lora is not None and plan.options.lora.quantize_base is not None
    # NF4 quantizes the real base, before FSDP shards it
    load = (lambda m: stream_qlora_base(plan, m, meshes, device)) if qlora and device is not None else None
    try:
        parallelize(model, meshes, plan.options, before_data_parallel=load)
    except TransformError as e:
        raise config_error(plan.cfg, e) from None
    if device is not None and not qlora:
        cpu_offload = plan.cfg.parallelism.fsdp_cpu_offload and plan.dims.fsdp_enabled  # parameters stay on the CPU
        materialize(model, device, seed=plan.cfg.training.seed, cpu_offload=cpu_offload)
    if device is not None:
        model.train()
        if spec.backend.count_routing is not None:  # transformers' routers counted for the routing metrics
            spec.backend.count_routing(model, device)
    return model


def build_stages(plan: RunPlan, model: nn.Module, meshes: Meshes, device: torch.device | None,
                 pp_rank: int | None = None) -> PipelineStages:
    """The stages of the meta model this rank holds under the pipeline layout (default split:
    embedding first, norm and output last, blocks spread evenly), each through `parallelize` and
    `materialize` like a whole model: every weight keeps its name and so its initial values.
    pp_rank: build another pipeline rank's stages instead (the dry run, on meta)."""
    layout, spec = plan.pipeline, plan.spec
    ids = layout.stage_ids(meshes.pp.get_local_rank() if pp_rank is None else pp_rank)
    stages = split_model(model, default_split(model, layout.n_stages), ids)
    for stage in stages:  # LoRA's targets were checked on the whole model (plan.check_lora): a stage may hold none
        try:
            parallelize(stage, meshes, plan.options)
        except TransformError as e:
            raise config_error(plan.cfg, e) from None
        if device is not None:
            cpu_offload = plan.cfg.parallelism.fsdp_cpu_offload and plan.dims.fsdp_enabled
            materialize(stage, device, seed=plan.cfg.training.seed, cpu_offload=cpu_offload)
            stage.train()
            if spec.backend.count_routing is not None:
                spec.backend.count_routing(stage, device)
    return PipelineStages(stages, ids, layout.n_stages, model, meshes.pp.get_group())


def stream_qlora_base(plan: RunPlan, model: nn.Module, meshes: Meshes | None, device: torch.device) -> nn.Module:
    """QLoRA's start-up one unit at a time (the token embedding, each block, the norm with the
    output): materialise the unit, fill it (the seeded initialisation, then the base from
    checkpoint.initial_load_path) and quantize its targets to NF4. The device holds the NF4 base
    so far and one unit in the compute dtype, never the whole base in it (Llama 3.1 70B: 141 GB in
    bf16, 40 GB in NF4). The weights equal a whole-model start's bit for bit. A model with tied
    embeddings (two units share a weight) starts whole."""
    seed, path = plan.cfg.training.seed, plan.cfg.checkpoint.initial_load_path
    if plan.model_args.tie_embeddings:
        return load_lora_base(plan, materialize(model, device, seed=seed))
    shards = meshes.fsdp.shape[-1] if meshes is not None and plan.dims.fsdp_enabled else 1  # as parallelize's FSDP
    for unit in pipeline_units(model):
        materialize_part(model, unit, device, seed=seed)
        if path:
            load_initial_weights(model, Path(path), names={f"{name}.{p}" for name in unit
                                                           for p, _ in model.get_submodule(name).named_parameters()})
        for name in unit:
            quantize_lora_base(model.get_submodule(name), shards=shards, log=False)
    # modules no unit holds (a transformers model's rotary table, model.rotary_emb): materialised and seeded
    rest = [name for name, module in model.named_modules() if name and any(
        t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))]
    if rest:
        materialize_part(model, rest, device, seed=seed)
    logger.info(f"QLoRA start-up: {len(pipeline_units(model))} units materialised, "
                f"{'loaded from ' + path if path else 'seeded'} and quantized to NF4 one at a time")
    return model


def lora_base_identity(plan: RunPlan) -> str | None:
    """What a LoRA run's frozen base is (None without LoRA): an adapter checkpoint records it and
    resumes only onto the same."""
    cfg = plan.cfg
    if not cfg.lora.enable:
        return None
    path = cfg.checkpoint.initial_load_path
    base = f"checkpoint.initial_load_path={Path(path).resolve()}" if path else f"seeded init, training.seed={cfg.training.seed}"
    return f"model.flavor={cfg.model.flavor}, {base}"


def load_lora_base(plan: RunPlan, model: nn.Module) -> nn.Module:
    """The frozen base of a LoRA run, from checkpoint.initial_load_path (read at every start: adapter
    checkpoints do not hold it); without one the seeded initialisation is the base."""
    if plan.cfg.checkpoint.initial_load_path:
        load_initial_weights(model, Path(plan.cfg.checkpoint.initial_load_path))
    return model


def build_data(plan: RunPlan, meshes: Meshes | None, device: torch.device):
    """The training loader (prepared ahead in a background thread, pinned on CUDA) and factories
    of validation loaders, by source (each evaluation reads the first batches of a fresh one).

    Every rank of one data-parallel replica (its TP and CP ranks) reads the same batches. Chat and
    prompt/completion samples are packed whole, each with its own positions and document id and
    labels only where the loss applies; the ranks count document lengths together, so each
    tokenizes little more than its own share. A data.mixture is one loader of one window per rank
    per source, drawn from by weight (components/data/mixture.py)."""
    own = plan.objective.loaders(plan, meshes)  # an objective's own data (online RL's prompts)
    if own is not None:
        return own
    cfg, make_loader = plan.cfg, loader_factory(plan, meshes)
    sources = plan.data_sources
    if sources:
        loader = Mixture([s.name for s in sources],
                         [make_loader(cfg.data.format, s.files, local_batch_size=1) for s in sources],
                         [s.weight for s in sources], local_batch_size=cfg.training.local_batch_size)
    else:
        loader = make_loader(cfg.data.format, plan.data_files)
    validation = {s.name: s.validation_files for s in sources if s.validation_files}  # validation.mixture
    if not validation and plan.validation_files:
        validation = {"": plan.validation_files}  # validation.dataset_path: one loss
    validation_format = cfg.validation.format or cfg.data.format
    validation_loaders = {name: functools.partial(make_loader, validation_format, files)
                          for name, files in validation.items()}
    return prefetch(loader, document_masking=cfg.data.document_masking, device=device), validation_loaders


def loader_factory(plan: RunPlan, meshes: Meshes | None) -> Callable[..., object]:
    """make(data_format, files, **overrides): a loader of this rank's share of `files`, as the run reads them."""
    cfg = plan.cfg
    return functools.partial(build_loader, tokenizer=plan.tokenizer, seq_len=cfg.training.seq_len,
                             local_batch_size=cfg.training.local_batch_size, **data_share(plan, meshes),
                             text_field=cfg.data.text_field, long_samples=cfg.data.long_samples,
                             truncation=cfg.preference.truncation)


def data_share(plan: RunPlan, meshes: Meshes | None) -> dict[str, int]:
    """This rank's place in the data-parallel stream (dp_rank of dp_world_size): under fault
    tolerance, replica group g's ranks read the g-th of replica_groups shares, as HSDP's replicas."""
    rank, size, ft = meshes.dp.get_local_rank() if meshes else 0, plan.dims.dp, plan.cfg.fault_tolerance
    if ft.enable:
        return {"dp_rank": ft.replica_id * size + rank, "dp_world_size": ft.replica_groups * size}
    return {"dp_rank": rank, "dp_world_size": size}


def build_optimizer_and_schedule(plan: RunPlan, model: nn.Module):
    """AdamW over the trainable parameters and its learning-rate schedule."""
    optimizer = build_optimizer(model, plan.cfg.optimizer)
    return optimizer, build_lr_scheduler(optimizer, plan.cfg.lr_scheduler, plan.cfg.training.steps)


def build_step(plan: RunPlan, model: nn.Module, optimizer, scheduler, meshes: Meshes | None,
               device: torch.device) -> StepSetup:
    """How each step runs in this layout: with loss parallel (tp > 1), the loss and its backward
    run where DTensor knows the logits are vocabulary-sharded; without FSDP to compute in bf16,
    autocast does (parallelisms/precision.py). MoE layers add their load-balancing loss, if asked."""
    cfg, dims = plan.cfg, plan.dims
    call = plan.spec.backend.forward  # a model whose call is not weft's (transformers')
    forward = functools.partial(model_forward, call=call) if call is not None else model_forward
    pipeline = None
    if plan.pipeline is not None:  # torch's schedule over this rank's stages, with the step's loss
        loss = PipelineLoss()  # its fn set by the objective
        schedule = build_schedule(model, model.stage_ids, model.n_stages, schedule=plan.pipeline.schedule,
                                  microbatches=plan.pipeline.microbatches, loss_fn=loss, device=device,
                                  pp_group=meshes.pp.get_group(), after_metadata_inference=reset_expert_counts)
        pipeline = PipelineStep(schedule=schedule, loss=loss, group=meshes.pp.get_group())
    forwards = cfg.training.gradient_accumulation_steps * (plan.pipeline.microbatches if plan.pipeline else 1)
    set_load_balance_loss(model, cfg.moe.load_balance_coeff, forwards)  # MoE layers: a mean over the step's forwards
    return StepSetup(
        pipeline=pipeline, forward=forward,
        model=model, optimizer=optimizer, scheduler=scheduler, device=device,
        max_norm=cfg.training.max_norm,
        loss_group=meshes.dp_cp.get_group() if meshes else None,
        grad_ranks=dims.dp * dims.cp,
        cp_mesh=meshes.cp if dims.cp > 1 else None,
        ep_group=meshes.ep.get_group() if dims.ep > 1 else None,
        routing_group=meshes.routing.get_group() if meshes else None,
        loss_context=loss_parallel if dims.tp > 1 and cfg.parallelism.loss_parallel else contextlib.nullcontext,
        forward_context=plan.precision.forward_context(),
        compiled_loss=cfg.compile.enable,
        precompute_float8=cfg.float8.enable and cfg.float8.precompute_float8_dynamic_scale_for_fsdp,
        moe_bias_rate=cfg.moe.bias_update_rate,
    )


def build_checkpointer(plan: RunPlan, model: nn.Module, optimizer, scheduler, loader) -> Checkpointer:
    """DCP checkpoints of model, optimizer, schedule and data cursor in the dump folder, with the
    data's fingerprint (a resume over changed data stops) and, under LoRA, the base it adapts."""
    return Checkpointer(plan.cfg.checkpoint, Path(plan.cfg.job.dump_folder), model=model, optimizer=optimizer,
                        scheduler=scheduler, dataloader=loader, extra_files={FINGERPRINT_FILE: plan.data_fingerprint},
                        base_identity=lora_base_identity(plan))


def build_fault_guards(plan: RunPlan, checkpointer: Checkpointer) -> tuple[NonFinitePolicy, CommTimeouts]:
    """The non-finite policy (a NaN/inf loss or gradient norm stops the run or skips the update,
    and is never saved) and the collective time limits (the long one until the first step is done
    and around saves and validation; a rank silent for longer is named in one line)."""
    t, comm = plan.cfg.training, plan.cfg.comm
    # A simulated rank's fake collectives leave garbage (NaN too) where a real one has data: only
    # its memory and time mean something, and a NaN must not end the measurement.
    policy = "ignore" if plan.cfg.job.simulate_world_size else t.on_nonfinite
    nonfinite = NonFinitePolicy(policy, t.max_skipped_steps, on_first=checkpointer.protect_before,
                                before_stop=lambda: checkpointer.finish_pending(True))
    return nonfinite, CommTimeouts(comm.init_timeout_seconds, comm.train_timeout_seconds,
                                   phases=PhaseRecord.for_job(), trace_note=trace_files_note(plan.cfg))


def build_fault_tolerance(plan: RunPlan, run: Training, checkpointer: Checkpointer,
                          start_step: int) -> NoFaultTolerance | ReplicaGroups:
    """[fault_tolerance]: this group's place among the replica groups (torchft), its step's gradients
    averaged over the live groups; off: every step commits, as without it. Under diloco the
    checkpoints hold DiLoCo's state too (global weights, outer momentum, place in the sync window),
    and a resumed run reads it back."""
    if not plan.cfg.fault_tolerance.enable:
        return NoFaultTolerance()
    if run.rank == 0:
        logger.info(describe_groups(plan.cfg, plan.dims.world_size))
    kind = DiLoCoGroups if plan.cfg.fault_tolerance.semi_sync_method == "diloco" else ReplicaGroups
    groups = kind(plan.cfg, run.device, training_state(run.model, run.optimizer, run.scheduler, run.loader),
                  run.model, run.optimizer, run.scheduler)
    if not groups.diloco:  # diloco syncs weights every fault_tolerance.sync_steps, from the optimizer's hook
        run.step.average_gradients = groups.average_gradients
        return groups
    checkpointer.states["diloco"] = groups
    if start_step and not checkpointer.load_state("diloco", start_step):
        logger.warning(f"fault tolerance: the checkpoint of step {start_step} holds no DiLoCo state (saved without "
                       "semi_sync_method = diloco); a new sync window starts from its weights, outer momentum zero")
    return groups


def restore(plan: RunPlan, checkpointer: Checkpointer, model: nn.Module) -> int:
    """Where to start, returned as the last completed step: the latest complete checkpoint in the
    dump folder (DCP reshards model, optimizer and data cursor into this layout, whatever layout
    saved them); else the seed checkpoint step-0 or checkpoint.initial_load_path; else 0 with the
    fresh initialisation."""
    ckpt = plan.cfg.checkpoint
    resume_step = checkpointer.resume_step() if ckpt.enable else None
    if plan.cfg.lora.enable:  # the base first (QLoRA's was loaded before quantizing), then the adapters
        if not plan.cfg.lora.quantize_base:
            load_lora_base(plan, model)
        if resume_step:
            checkpointer.load(resume_step)
        return resume_step or 0
    if resume_step == 0:
        load_model_weights(model, checkpointer.root / "step-0")
        logger.info("checkpoint: starting from the seed checkpoint step-0")
    elif resume_step is not None:
        checkpointer.load(resume_step)
        return resume_step
    elif ckpt.initial_load_path:
        load_initial_weights(model, Path(ckpt.initial_load_path))
    return 0


def load_initial_weights(model: nn.Module, path: Path, names: Collection[str] | None = None, *,
                         key: str = "checkpoint.initial_load_path") -> None:
    """Weights from a DCP checkpoint folder, or from a Hugging Face folder (has config.json);
    names: only these parameters; key: the config key that named `path`, in an error."""
    try:
        if (path / "config.json").is_file():
            load_hf_into_model(model, path, names)
        else:
            load_model_weights(model, path, names)
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e}") from None
    if names is None:
        logger.info(f"weights loaded from {path}")


def model_line(plan: RunPlan, model: nn.Module) -> str:
    """'model <flavor>: N parameters (A active per token), L on each rank'. N and A are the flavor's
    own (a plain meta model of it: a LoRA run's adapters are apply_lora's line, NF4 weights count as
    the weights they hold); L is what this rank holds, its shards and adapters included."""
    with torch.device("meta"):
        plain = plan.spec.build(plan.model_args)
    n_params, n_active = count_parameters(plain), active_parameters(plain)
    active = f" ({n_active:,} active per token)" if n_active != n_params else ""
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    adapters = " (the LoRA adapters included)" if plan.cfg.lora.enable else ""
    return f"model {plan.cfg.model.flavor}: {n_params:,} parameters{active}, {local:,} on each rank{adapters}"


def log_summary(plan: RunPlan, model: nn.Module) -> None:
    """The start-up summary: the model, its parameters per rank and who built it, precision, the global batch."""
    args = plan.model_args
    logger.info(f"{model_line(plan, model)} "
                f"({args.n_layers} layers, dim {args.dim}, {args.n_heads} heads, "
                f"{args.kv_heads} kv heads, vocab {args.vocab_size}); {backend_line(plan, model)}")
    logger.info(plan.precision.describe())
    logger.info(global_batch_line(plan))


def backend_line(plan: RunPlan, model: nn.Module) -> str:
    """Whose code built the model: weft's own family, or transformers' class (model.backend)."""
    return plan.spec.built_by(plan.model_args, whole_model(model))


def build_metrics(plan: RunPlan, model: nn.Module, device: torch.device, rank: int, start_step: int) -> MetricsLogger:
    """The log line, TensorBoard, metrics.jsonl and wandb (written by rank 0 only, from the first log)."""
    cfg, dump = plan.cfg, Path(plan.cfg.job.dump_folder)
    return MetricsLogger(
        device=device,
        flops_per_token=flops_per_token(plan.model_args, active_parameters(whole_model(model)),
                                        cfg.training.seq_len),
        tokens_per_step=plan.tokens_per_step,
        world_size=plan.dims.world_size,
        tb_folder=dump / "tb" if rank == 0 and cfg.metrics.enable_tensorboard else None,
        jsonl_path=dump / "metrics.jsonl" if rank == 0 else None,
        start_step=start_step,
        last_step=cfg.training.steps,
        slow_rank_threshold=cfg.metrics.slow_rank_threshold,
        wandb=WandbLogger(cfg) if rank == 0 and cfg.metrics.enable_wandb else None,
    )
