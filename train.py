"""Train a Llama model with weft. This file is the recipe: read it top to bottom, fork it freely.

    python train.py --job.config_file debug_model.toml
    torchrun --nproc_per_node 8 train.py --job.config_file llama8b.toml --training.steps 50

Every option is listed by `python train.py --help`; the TOML files in train_configs/ document
the defaults of each model size.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.checkpoint import Checkpointer, CheckpointError, check_resume, load_model_weights
from components.config import (
    ConfigError,
    JobConfig,
    check_dump_folder,
    parse_args,
    to_toml,
)
from components.data import DataError, check_text_files, find_text_files
from components.dry_run import dry_run, model_and_layout
from components.distributed import (
    Preemption,
    all_reduce_mean,
    collective_backend,
    init_distributed,
    launched_world_size,
    set_determinism,
    simulation_warning,
)
from components.errors import UserError, report_user_error
from components.hf import check_export_folder, export_at_end, load_hf_into_model, record_hf_files
from components.loss import IGNORE_INDEX, global_supervised_count, token_loss
from components.metrics import (
    MetricsLogger,
    StepStats,
    count_parameters,
    flops_per_token,
    setup_logging,
)
from components.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from components.prefetch import prefetch
from components.sft_data import Batch, batches, build_loader
from components.tokenizer import HFTokenizer, load_tokenizer
from float8 import (
    check_float8_support,
    float8_tp_all_gather,
    precompute_float8_scales,
)
from models.llama import ModelArgs, Transformer
from parallelisms.common import TransformError
from parallelisms.cp import shard_sequence
from parallelisms.materialize import materialize
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize
from parallelisms.precision import DTYPES, precision_policy

logger = logging.getLogger("weft")


def train(cfg: JobConfig) -> list[float]:
    """Run the training described by cfg; return the loss of every logged step."""

    # 0. --job.dry_run: plan this run in one process without devices (same transforms, meta
    #    device, fake process group), print the layout and a memory estimate, write nothing.
    if cfg.job.dry_run:
        dry_run(cfg, parallelize_model)
        return []

    # 1. Check everything the user can get wrong before any process group, file or tensor
    #    exists: a bad run then fails the same way on every rank, at once, writing nothing.
    model_args, dims, tokenizer, data_files, validation_files, float8_warnings = check_inputs(cfg)
    p, f8 = cfg.parallelism, cfg.float8

    # 2. Processes and devices. Mesh dims: dp_replicate, dp_shard, cp, tp (tp innermost).
    #    With job.simulate_world_size this one process is rank 0 of that many, collectives faked.
    device = init_distributed(simulate_world_size=cfg.job.simulate_world_size)
    meshes = dims.build_mesh(device.type) if dims.world_size > 1 else None
    rank = torch.distributed.get_rank() if meshes else 0
    setup_logging(rank)
    if cfg.job.simulate_world_size:
        logger.warning(simulation_warning(dims.world_size))
    for line in float8_warnings if rank == 0 else []:
        logger.warning(line)
    set_determinism(cfg.training.seed, cfg.training.deterministic)
    backend = f", collectives {collective_backend(device.type)}" if meshes and not cfg.job.simulate_world_size else ""
    logger.info(f"devices: {dims.world_size} x {device.type}{backend}; mesh {dims.describe()}")

    # 3. Data: every rank of one data-parallel replica (its TP and CP ranks) reads the same batches.
    #    Chat and prompt/completion samples are packed whole, each with its own positions and
    #    document id (attention stays inside it) and labels only where the loss applies. The ranks
    #    count document lengths together, so each tokenizes little more than its own share, and a
    #    background thread prepares the next micro-batches (pinned on CUDA) while a step runs.
    make_loader = functools.partial(
        build_loader,
        tokenizer=tokenizer,
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        dp_rank=meshes.dp.get_local_rank() if meshes else 0,
        dp_world_size=dims.dp,
        text_field=cfg.data.text_field,
        long_samples=cfg.data.long_samples,
    )
    loader = prefetch(make_loader(cfg.data.format, data_files), document_masking=cfg.data.document_masking,
                      device=device)

    # 4. The model, built on the meta device: shapes without memory, so any size fits here.
    with torch.device("meta"):
        model = Transformer(model_args)
    n_params = count_parameters(model)

    # 5. The transforms, in the one order that composes (written once, with the reason for each
    #    step, in parallelisms/parallelize.py). Each logs one line saying what it did.
    parallelize_model(model, cfg, meshes, device)

    # 6. Materialise on the device and initialise. Each parameter is drawn whole and every rank
    #    keeps its slice (parallelisms/materialize.py), so the weights equal a single-device
    #    run's with the same seed, whatever the layout.
    materialize(model, device, seed=cfg.training.seed)
    model.train()

    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    params = [p for p in model.parameters() if p.requires_grad]

    # 7. Where to start: the latest complete checkpoint in the dump folder (DCP reshards model,
    #    optimizer and data cursor into this layout, whatever layout saved them); else the
    #    seed checkpoint step-0 or checkpoint.initial_load_path; else the fresh initialisation.
    checkpointer = Checkpointer(cfg.checkpoint, Path(cfg.job.dump_folder), model=model, optimizer=optimizer,
                                scheduler=scheduler, dataloader=loader)
    start_step = 0
    resume_step = checkpointer.resume_step() if cfg.checkpoint.enable else None
    if resume_step == 0:
        load_model_weights(model, checkpointer.root / "step-0")
        logger.info("checkpoint: starting from the seed checkpoint step-0")
    elif resume_step is not None:
        checkpointer.load(resume_step)
        start_step = resume_step
    elif cfg.checkpoint.initial_load_path:
        load_initial_weights(model, Path(cfg.checkpoint.initial_load_path))

    # 8. The startup summary. Outputs (only rank 0 writes) wait until the first step is done: a run
    #    that fails before it (bad data, out of memory) leaves the dump folder as it found it.
    tokens_per_step = (cfg.training.seq_len * cfg.training.local_batch_size
                       * cfg.training.gradient_accumulation_steps * dims.dp)
    dump = Path(cfg.job.dump_folder)
    local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    logger.info(f"model {cfg.model.flavor}: {n_params:,} parameters, {local_params:,} on each rank "
                f"({model_args.n_layers} layers, dim {model_args.dim}, {model_args.n_heads} heads, "
                f"{model_args.kv_heads} kv heads, vocab {model_args.vocab_size})")
    precision = precision_policy(cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce,
                                 fsdp=dims.fsdp_enabled, device_type=device.type)
    logger.info(precision.describe())
    logger.info(f"global batch {cfg.training.local_batch_size} x {cfg.training.gradient_accumulation_steps} "
                f"accumulation x {dims.dp} dp = {tokens_per_step // cfg.training.seq_len} samples "
                f"= {tokens_per_step:,} tokens per step")
    if cfg.checkpoint.create_seed_checkpoint:
        write_config(dump, cfg)
        checkpointer.save(0, model_only=True, blocking=True)
        return []

    # 9. The loop. The loss is the mean over the supervised tokens of the whole global batch:
    #    their number is counted over all micro-batches and data/context-parallel ranks first,
    #    then each micro-batch contributes its sum of token losses (components/loss.py).
    loss_group = meshes.dp_cp.get_group() if meshes else None
    grad_ranks = dims.dp * dims.cp  # gradients are averaged over these ranks
    # With loss parallel, the loss and its backward must run where DTensor knows the logits are
    # vocabulary-sharded. Without FSDP to compute in bf16, autocast does (parallelisms/precision.py).
    loss_context = loss_parallel if dims.tp > 1 and p.loss_parallel else contextlib.nullcontext
    forward_context = precision.forward_context()
    accumulation = cfg.training.gradient_accumulation_steps
    metrics = MetricsLogger(
        device=device,
        flops_per_token=flops_per_token(model_args, n_params, cfg.training.seq_len),
        tokens_per_step=tokens_per_step,
        world_size=dims.world_size,
        tb_folder=dump / "tb" if rank == 0 and cfg.metrics.enable_tensorboard else None,
        jsonl_path=dump / "metrics.jsonl" if rank == 0 else None,
        start_step=start_step,
    )
    history: list[float] = []
    preemption = Preemption()
    step = start_step
    for step in range(start_step + 1, cfg.training.steps + 1):
        optimizer.zero_grad()
        step_loss = torch.zeros((), device=device)
        micro_batches = [next(loader).to(device, non_blocking=True) for _ in range(accumulation)]
        if dims.cp > 1:
            micro_batches = [shard_batch(meshes.cp, batch) for batch in micro_batches]
        supervised = global_supervised_count([batch.labels for batch in micro_batches], loss_group)
        for batch in micro_batches:
            with loss_context():
                with forward_context():
                    logits = model(batch.inputs, batch.positions, document_ids=batch.document_ids)
                loss = token_loss(logits, batch.labels, supervised, grad_ranks, compiled=cfg.compile.enable)
                del logits  # freed by backward, not held until the next forward
                loss.backward()
            step_loss += loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm)
        lr = scheduler.get_last_lr()[0]  # the rate this step's update used, read before it moves on
        optimizer.step()
        scheduler.step()
        if f8.enable and f8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(model)  # one fused amax all-reduce for the next float8 all-gather
        metrics.step_done()
        if step == start_step + 1 and rank == 0:
            write_config(dump, cfg)
            record_hf_files(dump, model_args, resolve_tokenizer_path(cfg), cfg.checkpoint.initial_load_path)

        if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
            loss_value = all_reduce_mean(step_loss, loss_group)
            stats = StepStats(step, loss_value, grad_norm.item(), lr)
            metrics.log(stats)
            history.append(stats.loss)
            report_long_samples(loader)

        if validation_files and (step % cfg.validation.freq == 0 or step == cfg.training.steps):
            with loss_context():
                validation_loss = evaluate(
                    model, make_loader(cfg.validation.format or cfg.data.format, validation_files),
                    cfg.validation.steps * accumulation, device=device, mesh=meshes.cp if dims.cp > 1 else None,
                    loss_group=loss_group, document_masking=cfg.data.document_masking, forward_context=forward_context,
                    compiled_loss=cfg.compile.enable)
            metrics.log_validation(step, validation_loss)

        saved = checkpointer.should_save(step, cfg.training.steps)
        if saved:
            checkpointer.save(step)
        else:
            checkpointer.finish_pending(wait=False)
        if preemption.requested():  # SIGTERM: save (if enabled) and stop cleanly on every rank
            if cfg.checkpoint.enable and not saved:
                checkpointer.save(step, blocking=True)
            logger.info(f"stopped by SIGTERM after step {step}")
            break

    checkpointer.close()
    if cfg.export.hf_folder and step == cfg.training.steps:  # a Hugging Face folder, streamed one tensor at a time
        export_at_end(model, dump, cfg.export.hf_folder, dtype=DTYPES[cfg.export.dtype],
                      max_shard_gib=cfg.export.max_shard_gib)
    loader.close()
    preemption.close()
    metrics.close()
    logger.info(f"done: {step} of {cfg.training.steps} steps")
    return history


def write_config(dump: Path, cfg: JobConfig) -> None:
    """The run's config as <dump>/config.toml (creating the folder): what resuming checks against."""
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "config.toml").write_text(to_toml(cfg))


def shard_batch(cp_mesh, batch: Batch) -> Batch:
    """This CP rank's shard of every tensor of the batch. Positions: the documents' own if packed,
    else the global positions `shard_sequence` returns; document ids travel with the tokens."""
    present = [t for t in batch if t is not None]
    shards, global_positions = shard_sequence(cp_mesh, *present)
    shards = iter(shards)
    sharded = Batch(*(None if t is None else next(shards) for t in batch))
    return sharded if batch.positions is not None else sharded._replace(positions=global_positions)


@torch.no_grad()
def evaluate(model, loader, steps: int, *, device, mesh, loss_group, document_masking: bool,
             forward_context, compiled_loss: bool) -> float:
    """Mean loss over the supervised tokens of the loader's first `steps` micro-batches.

    Runs in eval mode without gradients on a loader of its own, so the training data cursor
    and random state are untouched; sums and counts are reduced over data/context-parallel ranks,
    so every layout gets the same value."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for _, batch in zip(range(steps), batches(loader, document_masking=document_masking)):
        batch = batch.to(device)
        if mesh is not None:
            batch = shard_batch(mesh, batch)
        with forward_context():
            logits = model(batch.inputs, batch.positions, document_ids=batch.document_ids)
        loss_sum = token_loss(logits, batch.labels, 1.0, compiled=compiled_loss)
        total += (loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum).double()
        count += (batch.labels != IGNORE_INDEX).sum()
    if loss_group is not None:
        both = torch.stack((total, count))
        torch.distributed.all_reduce(both, group=loss_group)
        total, count = both[0], both[1]
    model.train()
    return (total / count.clamp(min=1)).item()


def report_long_samples(loader) -> None:
    """Log how many samples were cut or skipped for exceeding seq_len, if any."""
    truncated, dropped = getattr(loader, "truncated", 0), getattr(loader, "dropped", 0)
    if truncated or dropped:
        logger.info(f"data: {truncated} samples longer than training.seq_len + 1 tokens truncated, "
                    f"{dropped} dropped so far")


def resolve_tokenizer_path(cfg: JobConfig) -> str:
    """model.tokenizer_path, or by default the tokenizer of an initial Hugging Face folder, else
    the shipped Shakespeare tokenizer."""
    if cfg.model.tokenizer_path:
        return cfg.model.tokenizer_path
    initial = Path(cfg.checkpoint.initial_load_path) if cfg.checkpoint.initial_load_path else None
    if initial is not None and (initial / "tokenizer.json").is_file():
        return str(initial)
    return str(Path(__file__).resolve().parent / "assets/tokenizer/shakespeare.model")


def check_inputs(cfg: JobConfig) -> tuple[ModelArgs, ParallelDims, object, list[Path], list[Path], list[str]]:
    """Every check that needs no process group: model size, layout, tokenizer, data, dump folder,
    float8 support. Returns what they resolved, and float8 warnings to log."""
    check_simulation(cfg)
    model_args, dims = model_and_layout(cfg, cfg.job.simulate_world_size or launched_world_size())
    tokenizer = load_tokenizer(resolve_tokenizer_path(cfg))
    if tokenizer.vocab_size > model_args.vocab_size:
        raise DataError(
            f"model.tokenizer_path: the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than "
            f"the vocabulary of model flavor {cfg.model.flavor} ({model_args.vocab_size})"
        )
    data_files = find_text_files(cfg.data.dataset_path)
    validation_files = []
    if cfg.validation.enable:
        if not cfg.validation.dataset_path:
            raise ConfigError("validation.dataset_path: required when validation.enable is set")
        try:
            validation_files = find_text_files(cfg.validation.dataset_path)
        except DataError as e:
            raise DataError(str(e).replace("data.dataset_path", "validation.dataset_path", 1)) from None
    formats = {cfg.data.format, cfg.validation.format or cfg.data.format} if cfg.validation.enable else {cfg.data.format}
    if "chat" in formats and (not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is None):
        raise DataError(f"model.tokenizer_path: '{resolve_tokenizer_path(cfg)}' has no chat template, which "
                        "data.format = 'chat' needs (a Hugging Face folder whose tokenizer_config.json has one)")
    for data_format, files in [(cfg.data.format, data_files), (cfg.validation.format or cfg.data.format, validation_files)]:
        if files and data_format == "text":  # the start of every file: seconds even for a big corpus
            check_text_files(files, cfg.data.text_field)
        elif files:  # every record, checked before anything is written
            build_loader(data_format, files, tokenizer, seq_len=cfg.training.seq_len, local_batch_size=1,
                         dp_rank=0, dp_world_size=1).check_records()
    check_dump_folder(cfg)  # resuming is fine; reusing another experiment's folder is not
    if cfg.export.hf_folder:
        check_export_folder(Path(cfg.job.dump_folder), cfg.export.hf_folder)
    if cfg.checkpoint.enable:
        check_resume(cfg.checkpoint, Path(cfg.job.dump_folder), cfg.training.steps)
    f8 = cfg.float8
    float8_warnings = []
    if f8.enable:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            float8_warnings = check_float8_support(
                device_type,
                collective_backend(device_type) if dims.world_size > 1 else None,
                recipe=f8.recipe,
                enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
                precompute_float8_dynamic_scale_for_fsdp=f8.precompute_float8_dynamic_scale_for_fsdp,
                tp_degree=dims.tp,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.checkpoint.create_seed_checkpoint and dims.world_size > 1:
        raise ConfigError("checkpoint.create_seed_checkpoint: run it as one process (python train.py), "
                          f"not {dims.world_size}")
    return model_args, dims, tokenizer, data_files, validation_files, float8_warnings


# Which setting each transform argument comes from, to name it when a transform refuses it.
TRANSFORM_ARGUMENT_KEYS = {
    "tp_mesh": "parallelism.tp",
    "plan": "parallelism.tp",
    "cp_mesh": "parallelism.cp",
    "reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "mode": "activation_checkpoint.mode",
    "selective_option": "activation_checkpoint.selective_option",
    "model": "model.flavor",
    "compile": "compile.enable",
}


def parallelize_model(model: torch.nn.Module, cfg: JobConfig, meshes, device: torch.device) -> None:
    """parallelize() with its arguments read from the config; a refusal names the config key."""
    p, f8, ac = cfg.parallelism, cfg.float8, cfg.activation_checkpoint
    try:
        parallelize(
            model,
            meshes,
            float8_recipe=f8.recipe if f8.enable else None,
            float8_filter_fqns=f8.filter_fqns,
            float8_min_dim=f8.min_dim,
            float8_fsdp_all_gather=f8.enable_fsdp_float8_all_gather,
            float8_tp_all_gather=f8.enable and meshes is not None
            and float8_tp_all_gather(device.type, collective_backend(device.type), f8.recipe),
            loss_parallel=p.loss_parallel,
            ac_mode=ac.mode,
            ac_selective_option=ac.selective_option,
            compile=cfg.compile.enable,
            param_dtype=DTYPES[cfg.training.mixed_precision_param],
            reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce],
            reshard_after_forward=p.fsdp_reshard_after_forward,
            cpu_offload=p.fsdp_cpu_offload,
        )
    except TransformError as e:
        key = TRANSFORM_ARGUMENT_KEYS.get(e.argument, e.argument)
        raise ConfigError(f"{key} = {_setting(cfg, key)}: {e}") from None


def _setting(cfg: JobConfig, key: str) -> object:
    section, _, field = key.partition(".")
    return getattr(getattr(cfg, section, None), field, "?")


def check_simulation(cfg: JobConfig) -> None:
    """job.simulate_world_size plays rank 0 of a bigger job in one process: refuse what cannot work there."""
    simulated, launched = cfg.job.simulate_world_size, launched_world_size()
    if simulated and launched > 1:
        raise ConfigError(f"job.simulate_world_size: simulates {simulated} ranks in one process; "
                          f"run it as python train.py, not {launched} processes")
    if simulated and (cfg.checkpoint.enable or cfg.checkpoint.initial_load_path):
        raise ConfigError("job.simulate_world_size: checkpoints need real ranks (a fake rank would save or load "
                          "garbage); set checkpoint.enable = false and checkpoint.initial_load_path = ''")


def load_initial_weights(model: torch.nn.Module, path: Path) -> None:
    """Weights from a DCP checkpoint folder, or from a Hugging Face folder (has config.json)."""
    try:
        if (path / "config.json").is_file():
            load_hf_into_model(model, path)
        else:
            load_model_weights(model, path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.initial_load_path: {e}") from None
    logger.info(f"weights loaded from {path}")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        train(cfg)
    except UserError as e:  # any mistake the user can fix: one line, exit 2
        return report_user_error(e)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
