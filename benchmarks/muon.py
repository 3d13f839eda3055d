"""Muon against AdamW on CPU (gloo, fp32; Newton-Schulz in fp32, as bf16 matmuls are slow on CPUs):

1. the step time and the optimizer step's own time of the debug model under each layout (one
   process, fsdp 2, tp 2, each also with optimizer.muon_owner_ranks; ep 2 over fsdp 2 on the debug
   MoE), median of the timed steps after warm-up, through train.py's plan, `build_trainer` and
   `train_step`;
2. the debug model's training loss after --loss-steps steps (mean of the last 10) at each
   learning rate of a small grid, AdamW's lr, then Muon's muon_lr with AdamW on the rest at AdamW's
   best lr; one process, train.py's `train` on the shipped corpus (its step lines filtered out below).

Run from the repository root:
    OMP_NUM_THREADS=1 python benchmarks/muon.py [--steps 6] [--warmup 2] [--loss-steps 100] | grep -v '^\[weft'
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from weft import train
from weft.components.config import parse_args
from weft.components.data import Batch
from weft.components.distributed.cpu_ranks import run_distributed
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import train_step

BATCH, SEQ = 8, 128
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
OWNER = ["--optimizer.muon_owner_ranks"]
# name -> (world size, overrides, Muon's own overrides)
LAYOUTS = {
    "one process": (1, ["--parallelism.dp_shard", "1"], []),
    "fsdp 2": (2, ["--parallelism.dp_shard", "2"], []),
    "fsdp 2 owners": (2, ["--parallelism.dp_shard", "2"], OWNER),
    "tp 2": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"], []),
    "tp 2 owners": (2, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"], OWNER),
    "ep 2 (debug MoE)": (2, ["--job.config_file", "debug_moe", "--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
                         []),
}
ADAMW_LRS, MUON_LRS = (1e-3, 3e-3, 1e-2), (0.02, 0.05, 0.1)


def step_times(overrides: list[str], steps: int, warmup: int, seq: int = SEQ) -> dict[str, float]:
    """The median step and optimizer-step seconds of `steps` steps after `warmup`, on this process group."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    cfg = parse_args(["--job.config_file", "debug_model", "--training.local_batch_size", str(BATCH // world_size),
                      "--training.seq_len", str(seq), "--training.mixed_precision_param", "float32", *overrides])
    plan = RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)
    meshes = plan.dims.build_mesh("cpu") if world_size > 1 else None
    setup = build_trainer(plan, meshes, torch.device("cpu")).step
    starts: list[float] = []
    optimizer_times: list[float] = []
    setup.optimizer.register_step_pre_hook(lambda *_: starts.append(time.perf_counter()))
    setup.optimizer.register_step_post_hook(lambda *_: optimizer_times.append(time.perf_counter() - starts[-1]))
    generator = torch.Generator().manual_seed(dist.get_rank() if world_size > 1 else 0)
    shape = (2, BATCH // world_size, seq) if "--parallelism.tp" not in overrides else (2, BATCH, seq)
    times = []
    for i in range(warmup + steps):
        batch = Batch(*torch.randint(0, plan.model_args.vocab_size, shape, generator=generator))
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        train_step(setup, [batch])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"step": statistics.median(times), "optimizer": statistics.median(optimizer_times[warmup:])}


def layout_times(names: list[str], steps: int, warmup: int, seq: int) -> dict[str, dict[str, dict[str, float]]]:
    """Worker: AdamW's and Muon's times of each layout of this world size."""
    return {name: {"AdamW": step_times(LAYOUTS[name][1], steps, warmup, seq),
                   "Muon": step_times(LAYOUTS[name][1] + MUON + LAYOUTS[name][2], steps, warmup, seq)}
            for name in names}


def final_loss(overrides: list[str], steps: int, seq: int) -> float:
    with tempfile.TemporaryDirectory() as dump:
        losses = train.train(parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", dump, "--training.steps", str(steps),
            "--training.seq_len", str(seq), "--training.local_batch_size", str(BATCH),
            "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", str(max(1, steps // 10)),
            "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", *overrides]))
    return statistics.mean(losses[-10:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loss-steps", type=int, default=100)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layout names")
    parser.add_argument("--seq-len", type=int, default=SEQ)
    parser.add_argument("--lrs", type=int, default=len(ADAMW_LRS), help="learning rates of each grid tried")
    options = parser.parse_args()
    names = options.layouts.split(",")
    print(f"debug model (dim 256, 4 layers) and debug MoE, fp32, global batch {BATCH} x {options.seq_len} tokens, gloo; "
          f"{options.steps} timed steps after {options.warmup}; Newton-Schulz fp32; torch {torch.__version__}")
    times = {}
    for world_size in sorted({LAYOUTS[n][0] for n in names}):
        group = [n for n in names if LAYOUTS[n][0] == world_size]
        times.update(layout_times(group, options.steps, options.warmup, options.seq_len) if world_size == 1 else
                     run_distributed(layout_times, world_size, group, options.steps, options.warmup, options.seq_len,
                                     timeout=900)[0])
    print(f"{'layout':<18} {'AdamW step':>11} {'(optimizer)':>11} {'Muon step':>11} {'(optimizer)':>11} {'ratio':>6}")
    for name in names:
        a, m = times[name]["AdamW"], times[name]["Muon"]
        print(f"{name:<18} {a['step'] * 1e3:9.1f}ms {a['optimizer'] * 1e3:9.1f}ms {m['step'] * 1e3:9.1f}ms "
              f"{m['optimizer'] * 1e3:9.1f}ms {m['step'] / a['step']:6.2f}")
    print(f"loss after {options.loss_steps} steps (mean of the last 10), one process:")
    best = {}
    for lr in ADAMW_LRS[:options.lrs]:
        loss = final_loss(["--optimizer.lr", str(lr)], options.loss_steps, options.seq_len)
        best["AdamW"] = min(best.get("AdamW", (float("inf"), 0.0)), (loss, lr))
        print(f"  AdamW  --optimizer.lr {lr:<8g} loss {loss:.4f}")
    rest = best["AdamW"][1]  # Muon's AdamW part (embedding, output, norms) at AdamW's best lr
    for lr in MUON_LRS[:options.lrs]:
        loss = final_loss([*MUON, "--optimizer.lr", str(rest), "--optimizer.muon_lr", str(lr)], options.loss_steps,
                          options.seq_len)
        best["Muon"] = min(best.get("Muon", (float("inf"), 0.0)), (loss, lr))
        print(f"  Muon   --optimizer.muon_lr {lr:<8g} (--optimizer.lr {rest:g}) loss {loss:.4f}")
    for label, (loss, lr) in best.items():
        print(f"best {label}: loss {loss:.4f} at lr {lr:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
