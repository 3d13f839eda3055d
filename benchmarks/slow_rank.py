"""train.py with one rank's data made slow: each of its batches arrives `--delay` seconds late.
Shows what the log line's `slowest_rank R xF` and the ranks/* figures look like when a rank holds
the others back (README, "Slow ranks, time left, Weights & Biases").

    torchrun --nproc_per_node 8 benchmarks/slow_rank.py --rank 3 --delay 0.2 -- \\
        --job.config_file llama8b --training.steps 30 --metrics.log_freq 5

Arguments after `--` are train.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from weft import train
from weft.recipe.build import build_training


class SlowLoader:
    """A loader whose every batch arrives `delay` seconds late; all else is the loader's."""

    def __init__(self, loader, delay: float):
        self.loader, self.delay = loader, delay

    def __next__(self):
        time.sleep(self.delay)
        return next(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def slow_data(build_training, delay: float):
    """build_training, its run's loader made slow by `delay` seconds a batch."""
    def build(plan):
        run = build_training(plan)
        return dataclasses.replace(run, loader=SlowLoader(run.loader, delay))
    return build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=1, help="the rank whose data is slow")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds each of its batches is late")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    build = slow_data(build_training, args.delay) if int(os.environ.get("RANK", "0")) == args.rank else build_training
    return train.main(argv[split + 1:], build_training=build)


if __name__ == "__main__":
    sys.exit(main())
