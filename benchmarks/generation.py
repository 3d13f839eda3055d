"""The generation engine's speed and memory against transformers' generate and the old loop (issue 55).

For each model (a Llama-shaped one of about 58 M parameters, weft's llama spec, and the Qwen3-MoE debug
flavor; random weights, float32): 16 prompts of 32 to 128 random tokens, 128 new tokens each, greedy,
one batch. Prints the tokens/s of weft's `generate`, of transformers' `generate` on the same weights
(written by weft's export, read by AutoModelForCausalLM; its default cache, sdpa, the same batch
left-padded, min_new_tokens so that it also makes 128), of the loop generate.py ran before the engine
(the whole context recomputed for every token, one prompt at a time; timed once, on the --baseline-prompts
prompts nearest the batch's mean length, each making all its new tokens), the ratios (weft and transformers: the best of --repeats runs),
whether weft's tokens equal transformers', the bytes of weft's KV cache for the batch, and a ceiling: the
tokens/s weft would reach if its prefill and each decode step's matrix products (every nn.Linear on one
row per prompt, as the engine computes them) were all it spent (dense models).

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python benchmarks/generation.py
    python benchmarks/generation.py --device cuda --dtype bfloat16 [--compile]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from weft.components.hf.writer import save_hf_model
from weft.generate import cast_model
from weft.generation import SamplingParams, generate
from weft.models import flavors, spec_for_args

MODELS = {
    "llama_58m": replace(flavors()["debugmodel"], dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000,
                         multiple_of=256, max_seq_len=512),
    "debugmodel_qwen3_moe": flavors()["debugmodel_qwen3_moe"],
    # issue 58's 8B-class shape on one GPU: Llama 3.1 8B's width, heads and vocabulary, 4 of its 32 blocks
    "llama3_8b_4layers": replace(flavors()["llama3_8b"], n_layers=4, max_seq_len=1024),
}


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random token ids, their lengths spread evenly over 32 to 128."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(32, 128, count).round().int().tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def recompute_loop(model: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """A private copy of generate.py's loop before the engine: greedy, the whole context recomputed per token."""
    ids, device = list(prompt), next(model.parameters()).device
    for _ in range(tokens):
        ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
    return ids[len(prompt):]


def transformers_generate(hf: torch.nn.Module, batch: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy generate on the batch left-padded (pad id 0, masked), `tokens` new tokens each."""
    longest = max(map(len, batch))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch], device=hf.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch], device=hf.device)
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens,
                      min_new_tokens=tokens, pad_token_id=0)
    return out[:, longest:].tolist()


def cache_bytes(model: torch.nn.Module, batch: list[list[int]], tokens: int) -> int:
    """The bytes of the KV cache weft's engine holds for `batch` (allocated on its prefill)."""
    decoding = spec_for_args(model.args).backend.decoding
    longest = max(map(len, batch))
    cache = decoding.start(model, len(batch), longest + tokens - 1)
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch], device=device)
        valid = torch.tensor([[False] * (longest - len(p)) + [True] * len(p) for p in batch], device=device)
        decoding.forward(model, ids, (valid.cumsum(1) - 1).clamp(min=0), valid, cache)
        return cache.nbytes()
    finally:
        decoding.finish(model, cache)


def matmul_ceiling(model: torch.nn.Module, rows: int, repeats: int = 5) -> float:
    """Seconds of one decode step's matrix products: each nn.Linear's weight times `rows` rows (weights
    first on CPU, as generation/cpu_linears.py computes them), the best of `repeats`."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    cpu = weights[0].device.type == "cpu"
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            (w @ inputs[w.shape[1]].T).T.contiguous() if cpu else inputs[w.shape[1]] @ w.T
        if not cpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@torch.no_grad()
def run(name: str, args, opts: argparse.Namespace) -> None:
    model = spec_for_args(args).build(args)
    model.init_weights(seed=0)
    dtype = getattr(torch, opts.dtype)
    params = sum(p.numel() for p in model.parameters())
    batch = prompts(opts.prompts, args.vocab_size)
    new = opts.new_tokens
    with tempfile.TemporaryDirectory() as folder:
        save_hf_model(model, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval().to(opts.device)
    model = cast_model(model, dtype, torch.device(opts.device)).eval()  # the rotary table stays complex
    greedy = SamplingParams(max_completion_length=new, temperature=0)
    generate(model, batch[:2], replace(greedy, max_completion_length=4), compile=opts.compile)  # warm-up
    transformers_generate(hf, batch[:2], 4)
    weft_s = hf_s = float("inf")
    for _ in range(opts.repeats):  # interleaved, the best of each: the cores are shared, their load varies
        ours, seconds = timed(lambda: generate(model, batch, greedy, compile=opts.compile))
        weft_s = min(weft_s, seconds)
        theirs, seconds = timed(lambda: transformers_generate(hf, batch, new))
        hf_s = min(hf_s, seconds)
    mean = sum(map(len, batch)) / len(batch)  # the loop's cost grows with the context: prompts of the mean length
    few = sorted(batch, key=lambda p: abs(len(p) - mean))[:opts.baseline_prompts]
    _, loop_s = timed(lambda: [recompute_loop(model, p, new) for p in few])
    weft_tps, hf_tps = len(batch) * new / weft_s, len(batch) * new / hf_s
    loop_tps = len(few) * new / loop_s
    same = sum(c[0].token_ids == t for c, t in zip(ours, theirs))
    print(f"{name}: {params / 1e6:.1f} M parameters, {len(batch)} prompts of {min(map(len, batch))}-"
          f"{max(map(len, batch))} tokens, {new} new tokens each, greedy, {opts.dtype} on {opts.device}"
          f"{', compiled decode' if opts.compile else ''}, best of {opts.repeats}")
    print(f"  weft generate          {weft_tps:8.1f} tokens/s ({weft_s:.1f} s)")
    print(f"  transformers generate  {hf_tps:8.1f} tokens/s ({hf_s:.1f} s); weft / transformers = {weft_tps / hf_tps:.2f}x")
    print(f"  recompute loop         {loop_tps:8.1f} tokens/s ({loop_s:.1f} s for {len(few)} prompts of "
          f"{'/'.join(str(len(p)) for p in few)} tokens x {new}); weft / loop = {weft_tps / loop_tps:.1f}x")
    print(f"  same tokens as transformers: {same}/{len(batch)} prompts")
    print(f"  KV cache: {cache_bytes(model, batch, new) / 2**20:.1f} MiB for the batch")
    if any(p.ndim > 2 for p in model.parameters()):  # routed experts: a step reads only some of them
        return
    step_s = matmul_ceiling(model, len(batch))
    _, prefill_s = timed(lambda: generate(model, batch, replace(greedy, max_completion_length=1), compile=opts.compile))
    ceiling = len(batch) * new / (prefill_s + (new - 1) * step_s)
    print(f"  ceiling: weft's prefill ({prefill_s:.2f} s) and {new - 1} decode steps of matrix products alone "
          f"({step_s * 1e3:.1f} ms each) allow {ceiling:.1f} tokens/s ({ceiling / hf_tps:.2f}x transformers' generate)")


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--compile", action="store_true", help="weft's decode step under torch.compile")
    parser.add_argument("--baseline-prompts", type=int, default=2)
    return parser.parse_args(argv)


def main() -> None:
    opts = parse_cli()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name in opts.models:
        run(name, MODELS[name], opts)


if __name__ == "__main__":
    main()
