"""One GRPO step's split (generate / score / train) and the engine's generated tokens/s, from train.py.

For the debug model and the Qwen3-MoE debug flavor (random weights, float32 on CPU, bf16 on CUDA):
debug_grpo's prompts (assets/data/arithmetic) and reward functions, --prompts prompts a step x 4
completions of --completion-tokens new tokens at most, trained for --steps steps after --warmup. Each
step's seconds come from metrics.jsonl: generating and scoring as the objective timed them, training
the rest of the step (forward, backward, optimizer). Prints the medians and each part's share.

    OMP_NUM_THREADS=2 python benchmarks/rl_step.py
    python benchmarks/rl_step.py --device-args "--training.mixed_precision_param bfloat16"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from pathlib import Path

import torch

from weft import train
from weft.components.config import parse_args

FLAVORS = ("debugmodel", "debugmodel_qwen3_moe")


def step_split(flavor: str, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of each part of a step, the completions' mean length and the generated tokens/s."""
    completions = 4 * args.prompts
    with tempfile.TemporaryDirectory() as dump:
        train.train(parse_args([
            "--job.config_file", "debug_grpo", "--job.dump_folder", dump, "--model.flavor", flavor,
            "--training.steps", str(args.warmup + args.steps), "--training.local_batch_size", str(completions),
            "--training.seq_len", str(args.completion_tokens + 8), "--sampling.max_completion_length",
            str(args.completion_tokens), "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            "--validation.enable", "false", *shlex.split(args.device_args)]))
        records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "generation_seconds" in r][args.warmup:]
    step = statistics.median(r["ranks/step_seconds/max"] for r in records)
    generate = statistics.median(r["generation_seconds"] for r in records)
    score = statistics.median(r["score_seconds"] for r in records)
    length = statistics.median(r["completions/mean_length"] for r in records)
    return {"step": step, "generate": generate, "score": score, "train": step - generate - score,
            "length": length, "tokens_per_s": completions * length / generate}


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", nargs="+", default=list(FLAVORS), help="model flavors (weft's)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step (4 completions each)")
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device-args", default="", help="more train.py options (a GPU's dtype, compile)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_cli()
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else \
        f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {device}; {args.prompts} prompts x 4 completions of at most {args.completion_tokens} tokens a "
          f"step; medians of {args.steps} steps after {args.warmup} warmup")
    for flavor in args.flavors:
        split = step_split(flavor, args)
        shares = "  ".join(f"{part} {split[part]:.3f} s ({split[part] / split['step']:.0%})"
                           for part in ("generate", "score", "train"))
        print(f"{flavor:>22}: step {split['step']:.3f} s = {shares}; mean completion {split['length']:.1f} tokens, "
              f"generated {split['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
