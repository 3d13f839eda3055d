"""gpt-oss's costs on one device (issue 47): forward + backward time (median of --repeats after
--warmup) of

1. attention with sinks (`sink_attention`: FlexAttention with its log-sum-exp on CUDA, SDPA with a
   sink column elsewhere) over the whole past and over a sliding window, against plain causal SDPA
   on the same q, k, v;
2. one gpt-oss block (sink attention, router, 4 of the experts by grouped multiply), full and sliding;

and first checks the device's sink attention (values and the gradients of q, k, v and the sinks, in
a window and over two packed documents) against a plain softmax with a sink column in float32.

    OMP_NUM_THREADS=2 python benchmarks/gpt_oss.py                                # CPU, debug-sized
    python benchmarks/gpt_oss.py --device cuda --dtype bfloat16 --flavor gpt_oss_20b --seq 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from weft.layers.attention import sink_attention
from weft.models import spec_for_flavor


def timed(step: Callable[[], None], warmup: int, repeats: int, device: torch.device) -> float:
    """Median seconds of `step` (forward and backward)."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_sinks(device: torch.device, window: int = 4, seq: int = 64) -> dict[str, float]:
    """Largest difference of `sink_attention` on `device` (FlexAttention on CUDA, SDPA elsewhere)
    from the plain formula on the CPU, in its output and each input's gradient."""
    from weft.layers.attention import SinkAttention, window_causal_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, seq, 64, generator=g) for heads in (8, 2, 2))
    sinks = torch.randn(8, generator=g)
    documents = torch.cat([torch.zeros(2, seq // 3), torch.ones(2, seq - seq // 3)], 1).long()
    mask = SinkAttention(8, window).masks(seq, documents.to(device), 2, device)
    allowed = window_causal_mask(seq, window, documents)
    outputs = []
    for on, attend in ((device, lambda *t: sink_attention(*t, mask)), (torch.device("cpu"), lambda *t: _plain(*t, allowed))):
        inputs = [t.clone().to(on).requires_grad_() for t in (q, k, v, sinks)]
        out = attend(*inputs)
        (out * torch.linspace(-1, 1, 64, device=on)).sum().backward()
        outputs.append([t.detach().cpu().clone() for t in (out, *(i.grad for i in inputs))])
    return {name: (a - b).abs().max().item() for name, a, b in zip(("out", "q", "k", "v", "sinks"), *outputs)}


def _plain(q, k, v, sinks, allowed):
    """softmax([q kᵀ/√d, sink]) v without the sink's column, written out."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1] @ v


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel_gpt_oss")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    opts = parse_cli(argv)
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    differences = check_sinks(device)
    print("sink attention on", device, "against the plain formula (float32), largest difference:",
          ", ".join(f"{name} {value:.2e}" for name, value in differences.items()))
    spec = spec_for_flavor(opts.flavor)
    args = dataclasses.replace(spec.flavors[opts.flavor], n_layers=2, max_seq_len=max(opts.seq, 2))
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build(args)
        model.init_weights()
    for param in model.parameters():  # the parameters, not the complex rotary table
        param.data = param.data.to(dtype)
    results = {}

    b, s, hd = opts.batch, opts.seq, args.head_dim
    q = torch.randn(b, args.n_heads, s, hd, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, args.n_kv_heads, s, hd, device=device, dtype=dtype, requires_grad=True) for _ in "kv")

    def attention(attend) -> Callable[[], None]:
        return lambda: attend().float().sum().backward()

    results["attention: plain causal SDPA"] = timed(attention(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), opts.warmup, opts.repeats, device)
    for layer in model.layers.values():  # layer 0 sliding, layer 1 full
        core = layer.attention.core
        mask = core.masks(s, None, b, device)
        name = "full" if core.window is None else f"window {core.window}"
        results[f"attention: sinks, {name}"] = timed(attention(
            lambda core=core, mask=mask: sink_attention(q, k, v, core.sinks, mask)), opts.warmup, opts.repeats, device)

    x = torch.randn(b, s, args.dim, device=device, dtype=dtype, requires_grad=True)
    rotations = model.rope_rotations[:s]
    masks = {layer.attention.core.window: layer.attention.core.masks(s, None, b, device) for layer in model.layers.values()}
    for layer in model.layers.values():
        name = "full" if layer.attention.core.window is None else f"window {layer.attention.core.window}"
        results[f"block: {name}"] = timed(lambda layer=layer: layer(x, rotations, masks).float().sum().backward(),
                                          opts.warmup, opts.repeats, device)
    print(f"gpt-oss ({opts.flavor}'s shape), batch {b} x seq {s}, {opts.dtype} on {device}: forward + backward, "
          f"median of {opts.repeats}")
    for name, seconds in results.items():
        print(f"  {name:34s} {seconds * 1e3:9.2f} ms")
    return results


if __name__ == "__main__":
    main()
