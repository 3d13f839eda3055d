"""Train an LLM with weft (pretraining, SFT, LoRA/QLoRA, preference, online RL). The recipe: read it top to bottom, fork it.

    python train.py --job.config_file debug_model.toml
    torchrun --nproc_per_node 8 train.py --job.config_file llama8b.toml --training.steps 50

Every option is listed by `python train.py --help`; the TOML files in train_configs/ document
the defaults of each model size.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from weft.components.config import JobConfig, parse_args, to_toml
from weft.components.data.mixture import source_tokens
from weft.components.distributed.processes import Preemption, all_reduce_mean
from weft.components.distributed.timeouts import collective_failure
from weft.components.ft.groups import GroupStats
from weft.components.hf import record_hf_files
from weft.components.observe.metrics import MetricsLogger, StepStats
from weft.components.observe.profiling import StepProfiler
from weft.errors import UserError, report_user_error
from weft.recipe.build import (
    Training,
    build_checkpointer,
    build_fault_guards,
    build_fault_tolerance,
    build_metrics,
    build_training,
    log_summary,
    restore,
)
from weft.recipe.checks.launch import check_launch
from weft.recipe.dry_run import dry_run
from weft.recipe.export import export_after_training
from weft.recipe.plan import RunPlan, tokenizer_path
from weft.recipe.step import StepResult, train_step

logger = logging.getLogger("weft")


def train(cfg: JobConfig, *, build_training=build_training, train_step=train_step,
          make_preemption=Preemption) -> list[float]:
    """Run the training described by cfg; return the loss of every logged step. The keywords are
    the parts a test or benchmark may replace (slow data, a slowed step, a SIGTERM at step N)."""
    if cfg.job.dry_run:  # plan in one process on the meta device, print layout and memory, write nothing
        dry_run(cfg)
        return []

    # 1. Plan: check everything the user can get wrong before any process group, file or tensor
    #    exists, so a bad run fails the same way on every rank, at once, writing nothing.
    plan = RunPlan.from_config(cfg, check_launch(cfg))

    # 2. Build (recipe/build.py, in its one order): processes and meshes, data, the model
    #    (meta -> transforms -> weights), optimizer and schedule, how each step runs.
    run = build_training(plan)
    model, loader, step_setup, rank = run.model, run.loader, run.step, run.rank

    # 3. Resume: the latest checkpoint of this dump folder, else the initial weights. Outputs wait
    #    for the first step: a run that fails before it leaves the dump folder as it found it.
    checkpointer = build_checkpointer(plan, model, run.optimizer, run.scheduler, loader)
    start_step = restore(plan, checkpointer, model)
    step_setup.objective.prepare(plan, run, start_step)  # a precomputed reference; online RL's rollouts.jsonl trimmed
    log_summary(plan, model)
    if cfg.checkpoint.create_seed_checkpoint:
        write_config(Path(cfg.job.dump_folder), cfg)
        checkpointer.save(0, model_only=True, blocking=True)
        return []

    # 4. The loop: step, log, validate, checkpoint; SIGTERM saves and stops on every rank. The log
    #    gathers every rank's step time and data wait (the time in next_batches) to name a slow rank.
    metrics = build_metrics(plan, model, run.device, rank, start_step)
    preemption = make_preemption()
    try:  # whatever ends the run, even an error, gives SIGTERM back its previous handler
        nonfinite, timeouts = build_fault_guards(plan, checkpointer)  # NaN steps never saved; silent ranks named
        # [profiling]: a trace of one window in every profiling.freq steps, CUDA memory snapshots; off: inert
        profiler = StepProfiler(cfg.profiling, Path(cfg.job.dump_folder), run.device.type, rank, metrics, start_step)

        def on_phase(phase: str) -> None:  # as each phase of a step begins: a profiler region, and the
            timeouts.phase(phase)          # phase a silent rank is named with (gloo)
            profiler.on_phase(phase)

        # [fault_tolerance]: this job is one replica group of several (torchft); each step joins the live
        # groups first (a group behind them heals from a peer) and yields the next step to train; off: inert
        ft = build_fault_tolerance(plan, run, checkpointer, start_step)

        history: list[float] = []
        step, recorded = start_step, False
        for step in ft.steps(start_step, cfg.training.steps):
            timeouts.at_step(step)
            with profiler.step(step):  # a profiled step is left out of the throughput
                result = train_step(step_setup, metrics.next_batches(loader, cfg.training.gradient_accumulation_steps),
                                    on_phase=on_phase,
                                    allow_update=lambda grad_norm, loss: ft.should_commit()
                                    and nonfinite.allows_update(step, grad_norm, loss))
            metrics.step_done()
            if not ft.committed:  # a replica group died in this step: committed nowhere, tried again
                continue
            step = ft.step  # under DiLoCo a group healed at a sync goes on from its peer's step
            if not recorded and rank == 0:
                write_run_record(plan)
            recorded = True

            if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
                history.append(log_step(metrics, step, result, run, skipped=nonfinite.skipped, groups=ft.stats()))

            # Validation and checkpoint saves are left out of the throughput window (metrics.untimed).
            if run.validation_loaders and (step % cfg.validation.freq == 0 or step == cfg.training.steps):
                with metrics.untimed(), timeouts.long("validation"):
                    validate(cfg, run, metrics, step)

            saved = checkpointer.should_save(step, cfg.training.steps)
            with metrics.untimed(), timeouts.long("checkpoint" if saved else None):  # saves wait on the slowest writer
                if saved:
                    checkpointer.save(step)
                else:
                    checkpointer.finish_pending(wait=False)  # a failed background save is reported here
            if preemption.requested():
                if cfg.checkpoint.enable and not saved:
                    with timeouts.long("checkpoint"):
                        checkpointer.save(step, blocking=True)
                logger.info(f"stopped by SIGTERM after step {step}")
                break

        # 5. Close: pending saves finish, the data thread and the log files are closed.
        checkpointer.close()
        ft.close()
        profiler.close()
        if step == cfg.training.steps:
            export_after_training(plan, model)  # [export]: Hugging Face / PEFT folders, one tensor at a time
        loader.close()
        metrics.close()
    finally:
        preemption.close()
    logger.info(f"done: {step} of {cfg.training.steps} steps")
    return history


def log_step(metrics: MetricsLogger, step: int, result: StepResult, run: Training, *, skipped: int,
             groups: GroupStats | None) -> float:
    """The step's log line and records, its loss the mean over the ranks (returned); the samples
    cut or skipped so far for their length."""
    stats = StepStats(step, all_reduce_mean(result.loss, run.step.loss_group), result.grad_norm.item(), result.lr,
                      skipped_steps=skipped, moe_imbalance=result.moe_imbalance, ep_imbalance=result.ep_imbalance,
                      source_tokens=source_tokens(run.loader.state_dict()), groups=groups,
                      objective=result.metrics, objective_note=run.step.objective.log_note(result.metrics))
    metrics.log(stats)
    report_long_samples(run.loader)
    return stats.loss


def validate(cfg: JobConfig, run: Training, metrics: MetricsLogger, step: int) -> None:
    """One validation, logged: each source's loss, or a preference run's objective and rewards on its pairs."""
    losses, scalars = run.step.objective.validate(run, cfg)
    metrics.log_validation(step, losses, scalars, run.step.objective.log_note(scalars or {}))


def write_run_record(plan: RunPlan) -> None:
    """What later commands read back: the config (resuming checks it) and the Hugging Face files
    of the model (config.json, tokenizer, generation config) the export writes out."""
    cfg, dump = plan.cfg, Path(plan.cfg.job.dump_folder)
    write_config(dump, cfg)
    record_hf_files(dump, plan.model_args, tokenizer_path(cfg), cfg.checkpoint.initial_load_path)


def write_config(dump: Path, cfg: JobConfig) -> None:
    """The run's config as <dump>/config.toml (creating the folder): what resuming checks against."""
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "config.toml").write_text(to_toml(cfg))


def report_long_samples(loader) -> None:
    """Log how many samples were cut or skipped for exceeding seq_len, if any."""
    truncated, dropped = getattr(loader, "truncated", 0), getattr(loader, "dropped", 0)
    if truncated or dropped:
        logger.info(f"data: {truncated} samples longer than training.seq_len + 1 tokens truncated, "
                    f"{dropped} dropped so far")


def main(argv: list[str] | None = None, **parts) -> int:
    """train.py's command: exit 0, or 2 with one line for a mistake the user can fix. `parts`: train()'s keywords."""
    try:
        train(parse_args(argv), **parts)
    except UserError as e:  # any mistake the user can fix: one line, exit 2
        return report_user_error(e)
    except RuntimeError as e:  # a collective that timed out or lost a rank: one line naming the step
        if (fault := collective_failure(e)) is None:
            raise
        return report_user_error(fault)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
