"""What does [profiling] cost the steps it does not profile? Prints their step-time ratio, on / off.

One process builds train.py's plan, model, optimizer and step (recipe/plan.py, build.py, step.py)
once, then runs passes of `--steps` steps of train_step, each wrapped as train.py wraps it
(components/profiling.py's StepProfiler, its on_phase hook passed to train_step): with profiling
off, then on (a window of --warmup + --active steps every --freq steps, traces written to a
temporary folder). Passes alternate (off, on, off, on, ...) so drift in the machine's speed hits
both alike. Each step's train_step is timed; with profiling on only the steps outside a window
count, the steps the log's throughput counts (train.py leaves the windows and the profiler's
bookkeeping out of it).

    OMP_NUM_THREADS=2 python benchmarks/profiling.py                    # debug model on CPU
    python benchmarks/profiling.py --flavor llama3_1b --seq-len 2048 --batch 1   # on a GPU

Target: ratio <= 1.02 (the profiler costs nothing measurable outside its windows).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

from weft.components.config import Profiling, parse_args
from weft.components.data import Batch
from weft.components.metrics import MetricsLogger
from weft.components.profiling import StepProfiler, schedule_args
from weft.models import flavors
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import StepSetup, train_step


def build_setup(flavor: str, seq_len: int, batch: int, device: torch.device) -> tuple[StepSetup, RunPlan]:
    """train.py's plan, model, optimizer and step for this shape, in one process."""
    cfg = parse_args(["--job.config_file", "debug_model", "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                      "--training.local_batch_size", str(batch)])
    plan = RunPlan.from_config(cfg, 1, device_type=device.type, writes_dump_folder=False)  # measures, writes nothing
    return build_trainer(plan, None, device)[-1], plan


def timed_pass(setup: StepSetup, batch: Batch, cfg: Profiling, steps: int, dump: Path) -> dict[int, float]:
    """Seconds of each step's train_step, steps 1..steps, under a StepProfiler of `cfg`."""
    metrics = MetricsLogger(device=setup.device, flops_per_token=1.0, tokens_per_step=1, world_size=1,
                            tb_folder=None, jsonl_path=None)
    profiler = StepProfiler(cfg, dump, setup.device.type, 0, metrics)
    seconds = {}
    for step in range(1, steps + 1):
        with profiler.step(step):
            start = time.perf_counter()
            result = train_step(setup, [batch], on_phase=profiler.on_phase)
            result.loss.item()  # the step's kernels done
            seconds[step] = time.perf_counter() - start
    profiler.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(flavors()))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="steps per pass")
    parser.add_argument("--freq", type=int, default=10, help="profiling.freq of the passes with profiling on")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--active", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="passes of each kind")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup, plan = build_setup(args.flavor, args.seq_len, args.batch, device)
    tokens = torch.randint(0, plan.model_args.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:]).to(device)
    for _ in range(3):  # optimizer state, allocator and caches settle
        train_step(setup, [batch])

    on = Profiling(enable=True, freq=args.freq, warmup=args.warmup, active=args.active)
    schedule = torch.profiler.schedule(**schedule_args(args.freq, args.warmup, args.active))
    outside = [step for step in range(1, args.steps + 1) if schedule(step) == ProfilerAction.NONE]
    off_s, on_s, profiled_s = [], [], []
    with tempfile.TemporaryDirectory() as dump:
        for repeat in range(args.repeats):
            off_s += list(timed_pass(setup, batch, Profiling(), args.steps, Path(dump) / f"off-{repeat}").values())
            seconds = timed_pass(setup, batch, on, args.steps, Path(dump) / f"on-{repeat}")
            on_s += [seconds[step] for step in outside]
            profiled_s += [seconds[step] for step in seconds if step not in outside]
        traces = len(list(Path(dump).rglob("*.json.gz")))

    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {name}; model {args.flavor}, batch {args.batch} x seq {args.seq_len}, {args.steps} steps per pass, "
          f"{args.repeats} passes each; on: a window of {args.warmup} + {args.active} steps every {args.freq} "
          f"({traces} traces written)")
    off_ms, on_ms = 1000 * statistics.median(off_s), 1000 * statistics.median(on_s)
    print(f"step time off:                      median {off_ms:.2f} ms over {len(off_s)} steps")
    print(f"step time on, steps outside windows: median {on_ms:.2f} ms over {len(on_s)} steps")
    if profiled_s:
        print(f"step time on, steps inside windows:  median {1000 * statistics.median(profiled_s):.2f} ms "
              f"over {len(profiled_s)} steps (left out of the log's throughput)")
    ratio = on_ms / off_ms
    verdict = "met" if ratio <= 1.02 else "NOT met"
    print(f"ratio on / off (steps outside windows): {ratio:.3f}  (target <= 1.02: {verdict})")


if __name__ == "__main__":
    main()
