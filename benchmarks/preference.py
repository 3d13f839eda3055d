"""Step time of preference training (DPO) beside SFT on the same model and the same rows per step.

Writes Hamlet's lines as prompt/completion records and as preference pairs (the chosen answer the
line that follows, the rejected one its words reversed), then trains each mode with train.py:
SFT on prompt + chosen, DPO with a frozen reference copy, and under LoRA both again (DPO's reference
the policy with its adapters off). A DPO step carries `batch` pairs (2 x batch rows, each padded to
seq_len) and SFT `2 x batch` packed rows, so both put the same rows through the policy; DPO adds
the reference's forward. Modes alternate, so drift in the machine's speed hits all alike; prints
each mode's median step time and DPO / SFT per pair of modes. CUDA is used where present.

    OMP_NUM_THREADS=1 python benchmarks/preference.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from weft import train
from weft.assets.make_chat_data import speeches
from weft.components.config import parse_args

REPO = Path(__file__).resolve().parent.parent
LORA = ["--lora.enable", "--lora.rank", "8"]
MODES = {"sft": [], "dpo": [], "sft_lora": LORA, "dpo_lora": LORA}


def write_records(folder: Path, n: int) -> None:
    lines = [" ".join(s[1].split()) for s in speeches(REPO / "assets/data/shakespeare/hamlet.txt") if s is not None]
    pairs, completions = [], []
    for i in range(n):
        prompt, chosen = lines[i % len(lines)][:80] + "\n", lines[(i + 1) % len(lines)][:160]
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": " ".join(reversed(chosen.split()))})
        completions.append({"prompt": prompt, "completion": chosen})
    for name, records in (("pairs", pairs), ("sft", completions)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def step_seconds(folder: Path, mode: str, args: argparse.Namespace) -> float:
    """Median seconds per step of train.py after the warmup steps (the slowest rank's, every step logged)."""
    dpo = mode.startswith("dpo")
    data = ["--data.format", "preference", "--data.dataset_path", str(folder / "pairs.jsonl")] if dpo else \
        ["--data.format", "prompt_completion", "--data.dataset_path", str(folder / "sft.jsonl")]
    with tempfile.TemporaryDirectory() as dump:
        train.train(parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", dump, "--model.flavor", args.flavor,
            *data, *MODES[mode], "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch if dpo else 2 * args.batch),
            "--training.steps", str(args.warmup + args.steps), "--metrics.log_freq", "1",
            "--no-metrics.enable_tensorboard", "--no-validation.enable"]))
        records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["ranks/step_seconds/max"] for r in records[args.warmup:])


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="pairs per DPO step (SFT: twice as many rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_cli()

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        write_records(Path(folder), 512)
        for _ in range(args.repeats):
            for mode in MODES:
                times[mode].append(step_seconds(Path(folder), mode, args))
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else \
        f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {device}; {args.flavor}, {args.batch} pairs (DPO) or {2 * args.batch} rows (SFT) x seq "
          f"{args.seq_len}, {args.steps} timed steps after {args.warmup} warmup, {args.repeats} repeats")
    for mode in MODES:
        print(f"{mode:>9} ms/step: {', '.join(f'{1e3 * t:.1f}' for t in times[mode])}  "
              f"(median {1e3 * statistics.median(times[mode]):.1f})")
    for dpo, sft in (("dpo", "sft"), ("dpo_lora", "sft_lora")):
        print(f"ratio {dpo} / {sft} step time: {statistics.median(times[dpo]) / statistics.median(times[sft]):.3f}")


if __name__ == "__main__":
    main()
