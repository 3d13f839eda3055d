"""Single-GPU training throughput: weft's Llama in bf16 and float8, against Hugging Face.

A Llama-3-8B-shaped model (`llama3_8b` with fewer layers), one sequence of 8192 random tokens
per step, AdamW, measured over steady-state steps (warm-up and compilation excluded, the
device synchronised around every step). Configurations:

  bf16_eager                  weft model under FSDP2 on a 1-GPU mesh: fp32 master weights,
                              bf16 compute (MixedPrecisionPolicy param bf16, reduce fp32)
  bf16_compile                the same, each block compiled (parallelisms.compile.apply_compile)
  float8_tensorwise_compile   bf16_compile with every linear but `output` in float8, tensorwise
  float8_rowwise_compile      the same, rowwise scaling
  hf_compile                  transformers LlamaForCausalLM of the same shape: bf16 weights and
                              optimizer state, sdpa attention, torch.compile of the whole model

Why FSDP2 on a one-rank process group rather than autocast: it is the path weft trains on
at any scale, so the rows measure what multi-GPU runs use (the all-gather of one rank is a
copy), and torchao's float8 layers are built to compose with it. The float8 rows keep their
weights' all-gather in bf16 (with one rank it moves nothing between devices).

MFU is model FLOPs (components.metrics.flops_per_token) over the GPU's dense bf16 peak, for
every row, float8 ones included, so MFUs compare like tokens/s do. The HF row holds weights,
gradients and AdamW state in bf16 (no fp32 master weights): its peak memory is lower by
construction. Its rotary settings (theta, scaling) are HF's defaults: they change frequencies, not cost.

Run from the repository root:
  python -m benchmarks.gpu_throughput --out benchmarks/results/gpu_throughput.json
  python -m benchmarks.gpu_throughput --dry-run     # CPU, tiny shapes: checks the code end to end
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.metrics import count_parameters, device_peak_flops, flops_per_token, peak_memory_gib, setup_logging
from float8 import DEFAULT_MIN_DIM, apply_float8, check_float8_support
from models.llama import LLAMA_FLAVORS, ModelArgs, Transformer
from parallelisms.compile import apply_compile
from parallelisms.fsdp import apply_fsdp
from parallelisms.materialize import materialize

CONFIGS = ("bf16_eager", "bf16_compile", "float8_tensorwise_compile", "float8_rowwise_compile", "hf_compile")


@dataclass
class Row:
    """One configuration's measurements; MFU and the ratios are filled in once all rows are in."""

    config: str
    tokens_per_s: float  # over the timed steps: their tokens / their total time
    peak_gib: float | None  # None on CPU
    warmup_step_s: list[float]
    step_s: list[float]
    mfu_percent: float | None = None  # None where the device's peak is unknown
    vs_bf16_eager: float | None = None  # tokens/s ratios; None where that row is missing
    vs_hf: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --dry-run changes the defaults to tiny CPU settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="llama3_8b", choices=sorted(LLAMA_FLAVORS))
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (the flavor's shapes otherwise)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="steps run before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--float8-min-dim", type=int, default=DEFAULT_MIN_DIM,
                        help="linear layers with a smaller dimension stay in bf16")
    parser.add_argument("--out", type=Path, help="write the table and per-step timings here as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="defaults for a quick CPU check: debugmodel, 1 layer, seq-len 256, 1 warm-up + 2 "
                             "timed steps, float8-min-dim 16 (options given explicitly still win)")
    if parser.parse_known_args(argv)[0].dry_run:
        parser.set_defaults(device="cpu", flavor="debugmodel", layers=1, seq_len=256, warmup=1, steps=2,
                            float8_min_dim=16)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_weft(model_args: ModelArgs, mesh: DeviceMesh, *, compile: bool, float8_recipe: str | None,
               float8_min_dim: int) -> nn.Module:
    """The weft model as train.py builds it: float8, compile, FSDP on meta, then weights."""
    with torch.device("meta"):
        model = Transformer(model_args)
    if float8_recipe is not None:
        apply_float8(model, recipe=float8_recipe, min_dim=float8_min_dim)
    if compile:
        apply_compile(model)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    materialize(model, mesh.device_type, seed=0)  # on CUDA: the current device
    return model


def build_hf(model_args: ModelArgs, device: torch.device, seq_len: int, n_params: int) -> nn.Module:
    """transformers' LlamaForCausalLM of the same shape (checked by its parameter count): bf16
    weights, sdpa attention, compiled whole."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=model_args.vocab_size,
        hidden_size=model_args.dim,
        intermediate_size=model_args.ffn_hidden_dim,
        num_hidden_layers=model_args.n_layers,
        num_attention_heads=model_args.n_heads,
        num_key_value_heads=model_args.kv_heads,
        max_position_embeddings=max(seq_len, model_args.max_seq_len),
        rms_norm_eps=model_args.norm_eps,
        tie_word_embeddings=model_args.tie_embeddings,
        attn_implementation="sdpa",
        use_cache=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    hf_params = sum(p.numel() for p in model.parameters())
    if hf_params != n_params:
        raise RuntimeError(f"the transformers model has {hf_params:,} parameters, weft's {n_params:,}")
    return torch.compile(model)


def time_training(forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, *, vocab_size: int,
                  batch_size: int, seq_len: int, warmup: int, steps: int,
                  device: torch.device) -> tuple[list[float], list[float]]:
    """Seconds of each warm-up step and each timed step: forward, loss, backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(warmup + steps):
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device=device, generator=generator)
        synchronize(device)
        start = time.perf_counter()
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[:warmup], times[warmup:]


def run_config(config: str, model_args: ModelArgs, n_params: int, mesh: DeviceMesh, device: torch.device,
               opts: argparse.Namespace) -> Row:
    """Build one configuration on `device` (the mesh's), train it, and measure it."""
    if config == "hf_compile":
        model = build_hf(model_args, device, opts.seq_len, n_params)
        forward = lambda tokens: model(input_ids=tokens).logits  # noqa: E731
    else:
        recipe = config.split("_")[1] if config.startswith("float8") else None
        model = build_weft(model_args, mesh, compile=config.endswith("compile"), float8_recipe=recipe,
                           float8_min_dim=opts.float8_min_dim)
        forward = model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup_s, step_s = time_training(forward, model, vocab_size=model_args.vocab_size, batch_size=opts.batch_size,
                                     seq_len=opts.seq_len, warmup=opts.warmup, steps=opts.steps, device=device)
    tokens_per_s = opts.batch_size * opts.seq_len * len(step_s) / sum(step_s)
    peak = peak_memory_gib(device) if device.type == "cuda" else None  # CPU: no per-configuration peak
    return Row(config, tokens_per_s, peak, warmup_s, step_s)


def reasons_to_skip(configs: list[str], device: torch.device) -> dict[str, str]:
    """Configurations that cannot run here, each with the reason."""
    skipped = {}
    for config in configs:
        if config == "hf_compile" and importlib.util.find_spec("transformers") is None:
            skipped[config] = "transformers is not installed"
        if config.startswith("float8"):
            try:
                check_float8_support(device.type, dist.get_backend(), recipe=config.split("_")[1])
            except ValueError as error:
                skipped[config] = str(error)
    return skipped


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fill_derived(rows: list[Row], flops: float, peak_flops: float | None) -> None:
    """MFU against the bf16 peak, and throughput ratios to the two baselines."""
    for row in rows:
        if peak_flops is not None:
            row.mfu_percent = 100 * row.tokens_per_s * flops / peak_flops
    by_name = {row.config: row for row in rows}
    for row in rows:
        for base, field in (("bf16_eager", "vs_bf16_eager"), ("hf_compile", "vs_hf")):
            if base in by_name:
                setattr(row, field, row.tokens_per_s / by_name[base].tokens_per_s)


def format_table(rows: list[Row], skipped: dict[str, str]) -> str:
    """The results as an aligned text table, skipped configurations last with their reason."""
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [f"{'config':<27} {'tokens/s':>10} {'MFU %':>7} {'peak GiB':>9} {'vs bf16 eager':>14} {'vs HF':>7}"]
    for r in rows:
        lines.append(f"{r.config:<27} {r.tokens_per_s:>10,.0f} {num(r.mfu_percent, '.1f'):>7} "
                     f"{num(r.peak_gib, '.1f'):>9} {num(r.vs_bf16_eager, '.2f'):>14} {num(r.vs_hf, '.2f'):>7}")
    lines += [f"{name:<27} skipped: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run every requested configuration on one device, print the table, write the JSON."""
    opts = parse_args(argv)
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup_logging(rank=0)
    model_args = replace(LLAMA_FLAVORS[opts.flavor], n_layers=opts.layers,
                         max_seq_len=max(opts.seq_len, LLAMA_FLAVORS[opts.flavor].max_seq_len))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        n_params = count_parameters(Transformer(model_args))
    flops = flops_per_token(model_args, n_params, opts.seq_len)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{device_name}: {opts.flavor} with {opts.layers} layers ({n_params:,} parameters), "
          f"batch {opts.batch_size} x seq {opts.seq_len}, {opts.warmup} warm-up + {opts.steps} timed steps")

    skipped = reasons_to_skip(opts.configs, device)
    rows: list[Row] = []
    for config in opts.configs:
        if config in skipped:
            print(f"  {config}: skipped, {skipped[config]}")
            continue
        try:
            rows.append(run_config(config, model_args, n_params, mesh, device, opts))
            print(f"  {config}: {rows[-1].tokens_per_s:,.0f} tokens/s")
        except torch.cuda.OutOfMemoryError:
            skipped[config] = "out of GPU memory"
            print(f"  {config}: skipped, out of GPU memory")
        release_memory(device)
    fill_derived(rows, flops, device_peak_flops(device))
    print(format_table(rows, skipped))
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "device": device_name,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
            "n_params": n_params,
            "flops_per_token": flops,
            "peak_flops": device_peak_flops(device),
            "rows": [asdict(row) for row in rows],
            "skipped": skipped,
        }
        opts.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {opts.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
