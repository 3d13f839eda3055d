"""The MoE layer's cost, as ratios measured in one run (issue 27):

1. the routed experts as one grouped matrix multiply per projection (`torch._grouped_mm`) against
   a loop over experts, on the same tokens sorted by expert (and whether they agree);
2. the MoE block (router, routed experts, shared expert) against a dense SwiGLU block of the same
   active size (top_k × expert hidden + shared hidden), on the same tokens.

Each is timed over forward + backward (median of --repeats after --warmup); memory is what
autograd saves for the backward (any device) and, on CUDA, the allocator's peak above the start.

Issue 40 (the block at <= 1.2x the dense one): `--compile` compiles both blocks as training does
(each in one graph, inductor), so the router, the permutation and the un-permutation are fused as in
a compiled run; `--profile DIR` also profiles one forward + backward of each block and prints its
time by category (benchmarks/profiling.py's kernel_breakdown: the grouped multiply is GEMM, the
permutation and index_add elementwise/other).

    OMP_NUM_THREADS=2 python benchmarks/moe.py                               # CPU, debug-sized
    python benchmarks/moe.py --device cuda --dtype bfloat16 --shape scout    # one Scout layer
    python benchmarks/moe.py --device cuda --dtype bfloat16 --shape scout --compile --profile /tmp/moe
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from weft.benchmarks.profiling import format_breakdown, kernel_breakdown
from weft.models.common.feed_forward import FeedForward
from weft.models.common.moe import MoE, grouped, loop

# dim, expert hidden, experts, top_k, shared expert hidden, tokens
SHAPES = {
    "cpu": (256, 512, 8, 1, 512, 4096),
    "scout": (5120, 8192, 16, 1, 8192, 8192),
}


def measure(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int) -> dict:
    """Median seconds of fn() + its backward, the bytes autograd saves, CUDA's peak above start."""
    for _ in range(warmup):
        fn().float().square().mean().backward()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.float().square().mean().backward()
    peak = torch.cuda.max_memory_allocated() - start_bytes if device.type == "cuda" else None
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn().float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"s": statistics.median(times), "saved": sum(saved.values()), "peak": peak}


def profile(fn: Callable[[], torch.Tensor], device: torch.device, path: Path, title: str) -> None:
    """Profile one fn() + its backward into the chrome trace `path`; print its time by category."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        fn().float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    print(format_breakdown(kernel_breakdown(path), f"{title} ({path.name}), "))


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def row(name: str, a: dict, b: dict, a_name: str, b_name: str) -> str:
    gib = 2**30
    text = (f"{name}: {a_name} {a['s'] * 1e3:.2f} ms, {b_name} {b['s'] * 1e3:.2f} ms, "
            f"time {a_name}/{b_name} {a['s'] / b['s']:.3f}; saved for backward "
            f"{a['saved'] / gib:.3f} / {b['saved'] / gib:.3f} GiB = {a['saved'] / b['saved']:.3f}")
    if a["peak"] is not None:
        text += f"; CUDA peak {a['peak'] / gib:.3f} / {b['peak'] / gib:.3f} GiB = {a['peak'] / b['peak']:.3f}"
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shape", default="cpu", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, help="tokens per step (default: the shape's)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compile both blocks (fullgraph, inductor) as training does")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also profile one forward + backward of each block into DIR and print its time by category")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    dim, hidden, n_experts, top_k, shared, tokens = SHAPES[args.shape]
    tokens = args.tokens or tokens
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# benchmarks/moe.py on {name}, torch {torch.__version__}, {args.dtype}: dim {dim}, "
          f"expert hidden {hidden}, {n_experts} experts, top_k {top_k}, shared hidden {shared}, {tokens} tokens"
          + (", blocks compiled" if args.compile else ""))

    moe = MoE(dim, hidden, n_experts, top_k, shared_hidden_dim=shared).to(device, dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=dim**-0.5)
    x = torch.randn(tokens, dim, device=device, dtype=dtype)

    # 1. grouped multiply against the loop, on tokens routed by the (random) router
    with torch.no_grad():
        experts = moe.router(x).topk(top_k, dim=-1).indices.flatten()
    counts = torch.bincount(experts, minlength=n_experts)
    routed = x[(experts.argsort(stable=True) // top_k)].detach().requires_grad_(True)
    weights = (moe.experts.w1, moe.experts.w2, moe.experts.w3)
    print(f"tokens per expert: min {counts.min().item()}, max {counts.max().item()}")
    grouped_time = measure(lambda: grouped(routed, counts, *weights), device, args.warmup, args.repeats)
    loop_time = measure(lambda: loop(routed, counts, *weights), device, args.warmup, args.repeats)
    moe.zero_grad()  # the timed backwards accumulated into them
    out_g, out_l = grouped(routed, counts, *weights), loop(routed, counts, *weights)
    out_g.float().square().mean().backward()
    g_grads = grads(moe.experts)
    out_l.float().square().mean().backward()
    l_grads = grads(moe.experts)
    print(row("routed experts", grouped_time, loop_time, "grouped", "loop"))
    print(f"  grouped vs loop: output max relative difference {max_rel_diff([out_g], [out_l]):.2e}, "
          f"weight gradients {max_rel_diff(g_grads, l_grads):.2e}")

    # 2. the MoE block against a dense block of the same active size
    dense = FeedForward(dim, top_k * hidden + shared).to(device, dtype)
    xb = x.detach().requires_grad_(True)
    moe_fn, dense_fn = moe, dense
    if args.compile:  # as apply_compile compiles a block: one graph each
        moe_fn, dense_fn = torch.compile(moe, fullgraph=True), torch.compile(dense, fullgraph=True)
    block = measure(lambda: moe_fn(xb), device, args.warmup, args.repeats)
    ref = measure(lambda: dense_fn(xb), device, args.warmup, args.repeats)
    print(row("MoE block vs dense block of the same active size", block, ref, "MoE", "dense"))
    print(f"  parameters: MoE {sum(p.numel() for p in moe.parameters()):,}, "
          f"dense {sum(p.numel() for p in dense.parameters()):,}")
    if args.profile is not None:
        suffix = "_compiled" if args.compile else ""
        profile(lambda: moe_fn(xb), device, args.profile / f"moe_block{suffix}.json.gz", "MoE block")
        profile(lambda: dense_fn(xb), device, args.profile / f"dense_block{suffix}.json.gz", "dense block")


if __name__ == "__main__":
    main()
