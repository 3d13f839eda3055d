"""How many aten ops does one eager training step dispatch? Counts them by name, per step.

One step is train.py's own `train_step` (recipe/step.py) on one device: forward, the fp32 token
loss, backward, gradient clipping, AdamW, the schedule. Every op that reaches a kernel is counted once, forward and backward alike
(a TorchDispatchMode sits below autograd, so composite ops are counted as the kernels they
become, and views too; `_foreach_*` and `_fused_adamw_` count once each however many
tensors they take). Fewer element-wise ops is less launch overhead on a GPU and less memory
traffic everywhere; this makes the count visible without one.

    OMP_NUM_THREADS=2 python benchmarks/eager_ops.py                         # debug model, CPU
    python benchmarks/eager_ops.py --optimizer foreach --top 15              # what foreach costs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weft.components.config import parse_args
from weft.components.data import Batch
from weft.models import flavors
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import StepSetup, train_step


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by op name (overloads merged)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def build_setup(flavor: str, *, seq_len: int, batch: int, optimizer: str) -> tuple[StepSetup, RunPlan]:
    """train.py's plan, model, optimizer and step for this shape, on one CPU process."""
    cfg = parse_args(["--job.config_file", "debug_model", "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                      "--training.local_batch_size", str(batch), "--optimizer.implementation", optimizer])
    plan = RunPlan.from_config(cfg, 1, device_type="cpu", writes_dump_folder=False)  # measures, writes nothing
    return build_trainer(plan, None, torch.device("cpu")).step, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(flavors()))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--optimizer", default="auto", choices=("auto", "foreach", "fused", "for-loop"),
                        help="optimizer.implementation, as in train.py")
    parser.add_argument("--timed-steps", type=int, default=10, help="steps timed after the counted one")
    parser.add_argument("--top", type=int, default=10, help="print the most frequent ops")
    args = parser.parse_args()

    setup, plan = build_setup(args.flavor, seq_len=args.seq_len, batch=args.batch, optimizer=args.optimizer)
    optimizer, model_args = setup.optimizer, plan.model_args
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    train_step(setup, [batch])  # first step: optimizer state is created here

    counter = OpCounter()
    with counter:
        train_step(setup, [batch])
    seconds = []
    for _ in range(args.timed_steps):
        start = time.perf_counter()
        train_step(setup, [batch])
        seconds.append(time.perf_counter() - start)

    counts = counter.counts
    implementation = "fused" if optimizer.defaults.get("fused") else "foreach" if optimizer.defaults.get(
        "foreach") else "for-loop"
    print(f"{args.flavor} ({model_args.n_layers} layers), batch {args.batch} x seq {args.seq_len}, "
          f"AdamW {implementation}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"aten ops per step: {sum(counts.values())}  (mul {counts['mul']}, add {counts['add']}, "
          f"sub {counts['sub']}, stack {counts['stack']}, _local_scalar_dense {counts['_local_scalar_dense']})")
    print(f"step time: median {1000 * statistics.median(seconds):.1f} ms, min {1000 * min(seconds):.1f} ms "
          f"over {len(seconds)} steps")
    for name, n in counts.most_common(args.top):
        print(f"  {n:5d}  aten::{name}")


if __name__ == "__main__":
    main()
