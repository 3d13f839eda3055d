"""Step time of the transformers backend beside weft's own Qwen3, on one Qwen3 folder.

Writes a small Qwen3 folder with transformers (random weights), then trains it with train.py under
`--model.backend weft` and `--model.backend transformers`, alternating runs so that drift in the
machine's speed hits both alike; prints each backend's step times and the ratio of their medians.

    OMP_NUM_THREADS=1 python benchmarks/hf_backend.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from weft import train
from weft.components.config import parse_args

BACKENDS = ("weft", "transformers")


def qwen3_folder(folder: Path, dim: int, layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=2048, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=dim // 8,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)


def step_seconds(folder: Path, backend: str, seq_len: int, batch: int, warmup: int, steps: int) -> float:
    """Median seconds per step of train.py after `warmup` steps (the loss logged every step)."""
    with tempfile.TemporaryDirectory() as dump:
        train.train(parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", dump, "--model.flavor", "from_hf_config",
            "--checkpoint.initial_load_path", str(folder), "--model.backend", backend,
            "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--training.steps", str(warmup + steps), "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
            "--training.mixed_precision_param", "float32"]))
        records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(batch * seq_len / r["train/tokens_per_second"] for r in records[warmup:])


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_cli()

    times: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
    with tempfile.TemporaryDirectory() as folder:
        qwen3_folder(Path(folder), args.dim, args.layers)
        for _ in range(args.repeats):
            for backend in BACKENDS:
                times[backend].append(step_seconds(Path(folder), backend, args.seq_len, args.batch, args.warmup, args.steps))
    print(f"device: cpu ({torch.get_num_threads()} threads); Qwen3 folder dim {args.dim}, {args.layers} layers, "
          f"batch {args.batch} x seq {args.seq_len}, {args.steps} timed steps after {args.warmup} warmup, "
          f"{args.repeats} repeats")
    for backend in BACKENDS:
        print(f"{backend:>12} ms/step: {', '.join(f'{1e3 * t:.1f}' for t in times[backend])}  "
              f"(median {1e3 * statistics.median(times[backend]):.1f})")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["weft"])
    print(f"ratio transformers / weft step time: {ratio:.3f}")


if __name__ == "__main__":
    main()
