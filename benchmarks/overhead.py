"""How much does train.py cost over a bare training loop? Prints the ratio of their tokens/s.

Both train the same model (same flavor, seed, batch and sequence length, same data) with AdamW
and gradient clipping. The bare loop is the minimum anyone would write by hand; train.py adds
its logging, metrics, scheduler and data dealing. Runs alternate (bare, weft, bare, weft, ...)
so that drift in the machine's speed hits both alike; the ratio of medians is reported.

    OMP_NUM_THREADS=2 python benchmarks/overhead.py             # debug model on CPU
    python benchmarks/overhead.py --flavor llama3_1b --seq-len 2048 --batch 1   # on a GPU

Target: ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from weft import train
from weft.components.config import parse_args
from weft.components.data import Tokenizer, build_loader, find_text_files
from weft.models import flavors, spec_for_flavor

REPO = Path(__file__).resolve().parent.parent


def bare_loop_tokens_per_second(flavor: str, seq_len: int, batch: int, warmup: int, steps: int) -> float:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec_for_flavor(flavor).build(flavors()[flavor])
    model.to_empty(device=device)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    loader = build_loader("text", find_text_files(str(REPO / "assets/data/shakespeare")),
                          Tokenizer(REPO / "assets/tokenizer/shakespeare.model"), seq_len=seq_len, local_batch_size=batch)
    batches = iter(loader)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        micro_batch = next(batches).to(device)
        inputs, labels = micro_batch.inputs, micro_batch.labels
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    loss.item()  # wait for the last step
    return steps * batch * seq_len / (time.perf_counter() - start)


def weft_tokens_per_second(flavor: str, seq_len: int, batch: int, warmup: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as dump:
        cfg = parse_args([
            "--job.config_file", "debug_model", "--job.dump_folder", dump, "--model.flavor", flavor,
            "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--training.steps", str(warmup + steps), "--metrics.log_freq", str(warmup),
            "--no-metrics.enable_tensorboard", "--training.mixed_precision_param", "bfloat16",
        ])
        if steps % warmup:
            raise SystemExit("--steps must be a multiple of --warmup (train.py logs every `warmup` steps)")
        train.train(cfg)
        records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    windows = [r["train/tokens_per_second"] for r in records[1:]]  # the first window holds the warmup
    return len(windows) / sum(1 / w for w in windows)  # tokens/s over all timed steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    shape = (args.flavor, args.seq_len, args.batch, args.warmup, args.steps)
    bare, weft = [], []
    for _ in range(args.repeats):
        bare.append(bare_loop_tokens_per_second(*shape))
        weft.append(weft_tokens_per_second(*shape))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {device}; model {args.flavor}, batch {args.batch} x seq {args.seq_len}, "
          f"{args.steps} timed steps after {args.warmup} warmup, {args.repeats} repeats")
    print(f"bare loop tokens/s: {', '.join(f'{x:,.0f}' for x in bare)}  (median {statistics.median(bare):,.0f})")
    print(f"train.py  tokens/s: {', '.join(f'{x:,.0f}' for x in weft)}  (median {statistics.median(weft):,.0f})")
    ratio = statistics.median(weft) / statistics.median(bare)
    print(f"ratio train.py / bare loop: {ratio:.3f}  (target >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})")


if __name__ == "__main__":
    main()
