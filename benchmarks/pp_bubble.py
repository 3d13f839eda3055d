"""Pipeline bubble per schedule: step time under pp 2 against the no-bubble time of the same work.

Two CPU processes (gloo, one thread each) train the debug model under pp 2 with every schedule of
torch 2.13, on the same local batch cut into the same number of micro-batches, through the
recipe's own plan, build and step. The no-bubble time is one process running the whole model on
the same batch, divided by pp: what each of the pp ranks would spend if its stages never waited.
The measured bubble is 1 - no-bubble / step time (it includes the sends between stages, which the
theory leaves out); beside it the theoretical bubble of the schedule where the literature gives
one: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v·m + p - 1) for Interleaved1F1B with v
stages per rank (Narayanan et al., 2021).

Run from the repository root:  OMP_NUM_THREADS=1 python benchmarks/pp_bubble.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

from weft.components.config import parse_args
from weft.components.config.schema import PIPELINE_SCHEDULES
from weft.components.distributed.cpu_ranks import run_distributed

PP, MICROBATCHES, WARMUP, TIMED = 2, 4, 1, 3
ARGS = ["--job.config_file", "debug_model", "--training.seq_len", "256", "--training.local_batch_size", "8",
        "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32",
        "--training.steps", str(WARMUP + TIMED), "--no-metrics.enable_tensorboard"]


def step_seconds(extra: list[str], dump: str) -> float:
    """Median wall time of the timed steps (after warm-up) of the recipe's train_step."""
    import torch

    from weft.recipe.build import build_training
    from weft.recipe.plan import RunPlan
    from weft.recipe.step import train_step

    cfg = parse_args(ARGS + ["--job.dump_folder", dump, *extra])
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    plan = RunPlan.from_config(cfg, world)
    run = build_training(plan)
    loader, setup = run.loader, run.step
    times = []
    for step in range(WARMUP + TIMED):
        batch = [next(loader)]
        if world > 1:
            torch.distributed.barrier()
        start = time.perf_counter()
        train_step(setup, batch)
        if world > 1:
            torch.distributed.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    loader.close()
    return statistics.median(times)


def pipeline_times(dump: str) -> dict[str, float]:
    return {schedule: step_seconds(["--parallelism.pp", str(PP), "--parallelism.pp_schedule", schedule,
                                    "--parallelism.pp_microbatches", str(MICROBATCHES)], f"{dump}/{schedule}")
            for schedule in PIPELINE_SCHEDULES}


def theoretical_bubble(schedule: str) -> str:
    from weft.parallelisms.pipeline import stages_per_rank

    if schedule in ("GPipe", "1F1B"):
        return f"{(PP - 1) / (MICROBATCHES + PP - 1):.2f}"
    if schedule == "Interleaved1F1B":
        return f"{(PP - 1) / (stages_per_rank(schedule) * MICROBATCHES + PP - 1):.2f}"
    return "n/a"


def main() -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as dump:
        whole = step_seconds([], f"{dump}/one")
        times = run_distributed(pipeline_times, PP, dump, timeout=600)[0]
    no_bubble = whole / PP
    print(f"debug model, seq 256, local batch 8 in {MICROBATCHES} micro-batches, pp {PP} on gloo (CPU, 1 thread per "
          f"rank); one process, whole model: {whole * 1000:.0f} ms/step, so no-bubble {no_bubble * 1000:.0f} ms")
    print("| schedule | step time (ms) | no-bubble (ms) | measured bubble | theoretical bubble |")
    print("|---|---|---|---|---|")
    for schedule, seconds in times.items():
        print(f"| {schedule} | {seconds * 1000:.0f} | {no_bubble * 1000:.0f} | {1 - no_bubble / seconds:.2f} | "
              f"{theoretical_bubble(schedule)} |")


if __name__ == "__main__":
    main()
