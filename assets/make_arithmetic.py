"""Build the shipped arithmetic prompt set for online RL (data.format = prompts), offline.

    python assets/make_arithmetic.py     # writes assets/data/arithmetic/{train,validation,sft}.jsonl

Each prompt row is {"prompt": "37+45=", "answer": "82"}: sums of two numbers below 50, drawn from a
fixed seed; the validation rows are sums no training row asks. The answer column reaches the reward
functions by name (math_answer; assets/rewards/arithmetic.py). sft.jsonl holds the training sums as
{"prompt": "37+45=", "completion": "82"} records, to fine-tune a teacher for distillation (debug_distill).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent


def rows(seed: int = 0) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    pairs = [(a, b) for a in range(50) for b in range(50)]
    random.Random(seed).shuffle(pairs)
    made = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return made[:512], made[512:576]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ASSETS / "data" / "arithmetic"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    train, validation = rows()
    sft = [{"prompt": row["prompt"], "completion": row["answer"]} for row in train]
    for name, part in (("train", train), ("validation", validation), ("sft", sft)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
        print(f"{out / name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
