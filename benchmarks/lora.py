"""Step time and peak memory of full fine-tuning, LoRA and QLoRA on one shape, in one run.

Each mode builds its model, optimizer and step through the recipe (plan -> build_trainer, as
train.py builds them), in one process, and runs `--steps` of train.py's own `train_step` on random
tokens after one warm-up step. Peak memory: `torch.cuda.max_memory_allocated` on a GPU; on the CPU the
profiler's allocation totals (as tests/components/test_memory.py measures) plus what lives between steps.
Prints one line per mode and the ratios to full fine-tuning.

    python benchmarks/lora.py                                   # debug model, CPU
    python benchmarks/lora.py -- --model.flavor llama3_1b --training.seq_len 2048 \\
        --training.mixed_precision_param bfloat16 --activation_checkpoint.mode full   # one GPU

Arguments after `--` are train.py options applied to every mode (debug_model.toml underneath).
`--modes` picks the modes (the first is the one the others are compared with); `--layers` cuts the
flavor to its first blocks (as benchmarks/memory_check.py does). A mode that fails prints its error
and the others still run. Issue 38's MoE comparison, a Scout-shaped model cut to 2 blocks:

    python benchmarks/lora.py --layers 2 --modes lora qlora lora_experts qlora_experts -- \
        --model.flavor llama4_scout --training.seq_len 2048 --training.local_batch_size 1 \
        --training.mixed_precision_param bfloat16 --activation_checkpoint.mode full
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from weft import models
from weft.components.config import parse_args
from weft.components.data import Batch
from weft.components.memory import local_tensor, measured_peak_bytes
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import StepSetup, train_step

MODES = {
    "full": [],
    "lora": ["--lora.enable"],
    "qlora": ["--lora.enable", "--lora.quantize_base", "nf4"],
}
# Adapters on the routed experts too (issue 38), beside every block linear: MoE models only.
EXPERT_TARGETS = ["--lora.target_modules", "wq,wk,wv,wo,w1,w2,w3,experts"]
MODES.update(lora_experts=MODES["lora"] + EXPERT_TARGETS, qlora_experts=MODES["qlora"] + EXPERT_TARGETS)


def held_bytes(model, optimizer) -> int:
    """Parameters (NF4 as stored), optimizer state and buffers: what lives between steps."""
    total = 0
    for p in model.parameters():
        t = local_tensor(p)
        if hasattr(t, "quantized_data"):
            total += t.quantized_data.nbytes + t.quantized_scalers.nbytes + t.quantization_factor.nbytes
        else:
            total += t.numel() * t.element_size()
    total += sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def build_setup(overrides: list[str], device: torch.device) -> tuple[StepSetup, RunPlan]:
    """train.py's plan, model, optimizer and step for the debug config with these options, in one process."""
    cfg = parse_args(["--job.config_file", "debug_model", "--training.local_batch_size", "4", *overrides])
    plan = RunPlan.from_config(cfg, 1, device_type=device.type, check_environment=False)
    return build_trainer(plan, None, device).step, plan


def run_mode(overrides: list[str], steps: int, device: torch.device) -> tuple[float, int]:
    setup, plan = build_setup(overrides, device)
    vocab, cfg = plan.model_args.vocab_size, plan.cfg
    shape = (2, cfg.training.local_batch_size, cfg.training.seq_len)
    generator = torch.Generator().manual_seed(0)

    def step():  # train.py's step on random tokens
        inputs, labels = (t.to(device) for t in torch.randint(0, vocab, shape, generator=generator))
        train_step(setup, [Batch(inputs, labels)])

    step()  # warm-up: optimizer state, allocator caches
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = held_bytes(setup.model, setup.optimizer) + measured_peak_bytes(step)
    return seconds, peak


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["full", "lora", "qlora"], choices=sorted(MODES),
                        help="modes to run, in order; the first is the baseline of the ratios")
    parser.add_argument("--layers", type=int, help="blocks of the flavor to keep (default: all)")
    parser.add_argument("overrides", nargs="*", help="train.py options after --")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_cli()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    specs = models.MODEL_SPECS
    if args.layers:
        from weft.benchmarks.memory_check import with_layers

        specs = with_layers(parse_args(["--job.config_file", "debug_model", *args.overrides]).model.flavor, args.layers)
    results: dict[str, tuple[float, int] | str] = {}
    with mock.patch.object(models, "MODEL_SPECS", specs):
        for name in args.modes:
            try:
                results[name] = run_mode([*args.overrides, *MODES[name]], args.steps, device)
            except Exception as error:  # noqa: BLE001 - one mode's failure must not cost the others
                results[name] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"[:300]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"device {device.type}, {args.steps} steps after a warm-up, train.py options: "
          f"{' '.join(args.overrides) or '(debug_model)'}" + (f", {args.layers} layers" if args.layers else ""))
    base = next((r for r in results.values() if not isinstance(r, str)), None)
    for name, result in results.items():
        if isinstance(result, str):
            print(f"{name:13s} error: {result}")
            continue
        seconds, peak = result
        print(f"{name:13s} step {seconds * 1000:9.1f} ms ({seconds / base[0]:5.2f}x {args.modes[0]})   "
              f"peak {peak / 2**20:9.1f} MiB ({peak / base[1]:5.2f}x {args.modes[0]})")


if __name__ == "__main__":
    main()
