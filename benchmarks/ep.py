"""Expert parallelism on the debug MoE (CPU, gloo, fp32), in one run:

1. the bytes the all-to-alls move in one training step, against the theory. Per MoE layer a rank
   sends its routed rows (local tokens × top_k, dim values each) to the experts' ranks and, in
   the combine, the rows its experts received; backward runs both in reverse. Counting each
   all-to-all's input, a rank moves 2 · (tokens · top_k + received) · dim · 4 bytes per layer,
   where what it receives depends on the routing; over the ranks the received rows are the sent
   ones, so the ranks together move exactly ranks · 4 · tokens · top_k · dim · 4 bytes per layer.
   Plus the exchange of the n_experts token counts (8-byte integers) in each forward;
2. the step time of ep 2 (over fsdp 2) against fsdp 2 alone, as a ratio (median of the timed
   steps, after warm-up steps).

Both layouts are train.py's own (its plan, `build_trainer`, `train_step`). The all-to-alls are
counted at the dispatcher (`alltoall_base_`, the functional all_to_all_single), so the step's
own calls are what is measured. Run from the repository root:
    OMP_NUM_THREADS=1 python benchmarks/ep.py [--steps 8] [--warmup 2]
Exit code 0 when the measured bytes equal the theory (the ranks' total, and the counts on each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from weft.components.config import parse_args
from weft.components.data import Batch
from weft.components.distributed.cpu_ranks import run_distributed
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import train_step

BATCH, SEQ = 4, 128
_ALL_TO_ALL = {torch.ops.c10d.alltoall_base_.default, torch.ops._c10d_functional.all_to_all_single.default,
               torch.ops._c10d_functional_autograd.all_to_all_single.default}


class AllToAllCounter(TorchDispatchMode):
    """Bytes of the input of every all-to-all this rank issues, floating (tokens) and integer (counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_bytes = self.count_bytes = self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ALL_TO_ALL:
            source = args[1] if func is torch.ops.c10d.alltoall_base_.default else args[0]
            nbytes = source.numel() * source.element_size()
            if source.is_floating_point():
                self.token_bytes += nbytes
            else:
                self.count_bytes += nbytes
            self.calls += 1
        return func(*args, **(kwargs or {}))


def plan_for(ep: int, world_size: int) -> RunPlan:
    cfg = parse_args(["--job.config_file", "debug_moe", "--training.local_batch_size", str(BATCH),
                      "--training.seq_len", str(SEQ), "--parallelism.dp_shard", str(world_size),
                      "--parallelism.ep", str(ep), "--optimizer.implementation", "fused"])
    return RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)


def measure(ep: int, steps: int, warmup: int) -> dict:
    """Worker: the step times of `steps` steps after `warmup`, and one step's all-to-all bytes."""
    plan = plan_for(ep, dist.get_world_size())
    meshes = plan.dims.build_mesh("cpu")
    setup = build_trainer(plan, meshes, torch.device("cpu")).step
    args = plan.model_args
    generator = torch.Generator().manual_seed(meshes.dp.get_local_rank())
    batches = [Batch(*torch.randint(0, args.vocab_size, (2, BATCH, SEQ), generator=generator))
               for _ in range(warmup + steps + 1)]
    times = []
    for i, batch in enumerate(batches[:-1]):
        dist.barrier()
        start = time.perf_counter()
        train_step(setup, [batch])
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    counter = AllToAllCounter()
    with counter:
        train_step(setup, [batches[-1]])
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    theory = moe_layers * 4 * BATCH * SEQ * args.top_k * args.dim * 4 if ep > 1 else 0
    counts = moe_layers * args.n_experts * 8 if ep > 1 else 0
    return {"median_s": statistics.median(times), "token_bytes": counter.token_bytes,
            "count_bytes": counter.count_bytes, "calls": counter.calls, "theory": theory, "counts_theory": counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    options = parser.parse_args()
    print(f"debug MoE (Llama 4 debugmodel_moe: 4 experts, top 2, 2 MoE layers), fp32, local batch {BATCH} x {SEQ} "
          f"tokens, 2 ranks (gloo), {options.steps} timed steps after {options.warmup}")
    results = {}
    for ep in (1, 2):
        results[ep] = run_distributed(measure, 2, ep, options.steps, options.warmup, timeout=900)
    ok = True
    for ep, per_rank in results.items():
        name = "ep 2 over fsdp 2" if ep > 1 else "fsdp 2"
        for rank, r in enumerate(per_rank):
            ok &= r["count_bytes"] == r["counts_theory"]
            print(f"{name:>16}  rank {rank}: step {r['median_s'] * 1e3:7.1f} ms; all-to-all {r['calls']} calls, "
                  f"tokens {r['token_bytes']:,} B ({r['token_bytes'] / max(r['theory'], 1):.3f} of the mean), "
                  f"counts {r['count_bytes']:,} B (theory {r['counts_theory']:,})")
        total, theory = sum(r["token_bytes"] for r in per_rank), sum(r["theory"] for r in per_rank)
        ok &= total == theory
        print(f"{name:>16}  ranks together: tokens {total:,} B, theory {theory:,} B "
              f"{'(equal)' if total == theory else '(MISMATCH)'}")
    ratio = statistics.mean(r["median_s"] for r in results[2]) / statistics.mean(r["median_s"] for r in results[1])
    print(f"step time ep 2 / fsdp 2: {ratio:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
