"""What the loss costs on top of the logits: eager fp32 cross-entropy vs weft's chunked one vs compiled.

The loss of a training step starts from the output projection's logits [tokens, vocab] in the
compute dtype (bf16) and ends with their gradient in the same dtype. What happens in between is
what this measures, for one forward + backward of the loss alone:

  eager     F.cross_entropy(logits.float(), labels): the fp32 copy, its log-softmax (kept for
            backward), and in backward fp32 gradients of both before the cast back to bf16
  chunked   components/loss.chunked_cross_entropy, what train.py runs: fp32 only for a chunk of
            rows at a time; one log-sum-exp per row kept for backward
  compiled  components/loss.compiled_cross_entropy, what compiled runs use: torch.compile(eager)
            with inductor, the fp32 work fused into its kernels

For each: the peak memory above the logits (on CUDA torch.cuda.max_memory_allocated, on CPU the
profiler's running total of allocations, components/memory.measured_peak_bytes), the median time
of --repeats runs, and the differences of the loss (relative) and of the gradient (largest
absolute element) from the eager result. The
bf16 logits (held anyway) and their bf16 gradient (backward needs it anyway) are printed as the
floor no method can go below.

    OMP_NUM_THREADS=2 python benchmarks/loss_memory.py --tokens 4096 --vocab 128256
    python benchmarks/loss_memory.py --device cuda --tokens 8192 --vocab 128256   # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from weft.components.memory import GIB, measured_peak_bytes
from weft.components.training.loss import chunked_cross_entropy, compiled_cross_entropy


def eager(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def peak_above_start(fn, device: torch.device) -> int:
    """Bytes fn() allocated at its peak on top of what was live when it started."""
    if device.type != "cuda":
        return measured_peak_bytes(fn)
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="rows of logits: local batch × seq_len")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="eager,chunked,compiled")
    opts = parser.parse_args()
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)

    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(opts.tokens, opts.vocab, device=device, dtype=dtype, generator=generator).requires_grad_()
    labels = torch.randint(0, opts.vocab, (opts.tokens,), device=device, generator=generator)
    methods = {"eager": eager, "chunked": chunked_cross_entropy, "compiled": compiled_cross_entropy}
    element = logits.element_size()
    floor = opts.tokens * opts.vocab * element
    print(f"loss of {opts.tokens} tokens x {opts.vocab} vocab, {opts.dtype} logits on {device} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"logits: {floor / GIB:.2f} GiB; their gradient, which backward must make: {floor / GIB:.2f} GiB")
    print(f"{'method':<10} {'peak above logits':>18} {'x logits':>9} {'median ms':>10} "
          f"{'loss rel. diff':>15} {'max |grad - eager|':>19}")

    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for name in opts.methods.split(","):
        loss_fn = methods[name]

        def step() -> torch.Tensor:
            logits.grad = None
            loss = loss_fn(logits, labels)
            loss.backward()
            return loss.detach()

        step()  # warm-up (and compilation)
        logits.grad = None
        peak = peak_above_start(step, device)
        times = []
        for _ in range(opts.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        grad = logits.grad.float()
        if reference is None:
            reference = loss.float(), grad
        loss_diff = ((loss.float() - reference[0]).abs() / reference[0].abs()).item()
        grad_diff = (grad - reference[1]).abs().max().item()
        logits.grad = None
        print(f"{name:<10} {peak / GIB:>14.2f} GiB {peak / floor:>9.2f} {statistics.median(times):>10.1f} "
              f"{loss_diff:>15.3g} {grad_diff:>19.3g}", flush=True)


if __name__ == "__main__":
    main()
