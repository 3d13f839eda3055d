"""Single-GPU training throughput: weft's Llama in bf16 and float8, against Hugging Face.

A Llama-3-8B-shaped model (`llama3_8b` with as many blocks as fit, see `default_layers`), one
sequence of 8192 random tokens per step. Every row trains with train.py's own step
(recipe/step.py: train_step): forward, cross-entropy in fp32, backward, gradient clipping at norm
1, fused AdamW over fp32 master weights, timed
over steady-state steps (warm-up and compilation excluded, the device synchronised around every
step). The loss is each library's own: weft's rows call train.py's `token_loss` (compiled with
the row, else chunked: components/training/loss.py), transformers' rows the eager
`F.cross_entropy(logits.float())` its causal-LM loss runs. Rows (`<kind>_<eager|compile>`, compile = each decoder
block compiled on its own):

  bf16_*                     weft under FSDP2 on a one-rank mesh: bf16 compute through FSDP's
                             MixedPrecisionPolicy (param bf16, reduce fp32), the path every
                             multi-GPU run takes (with one rank the all-gather is a copy)
  float8_tensorwise_*        bf16_* with every linear but `output` in float8 (torchao), tensorwise
  float8_rowwise_*           the same, rowwise scaling
  autocast_*                 weft as train.py runs it on one GPU: no FSDP, fp32 weights, forward
                             under torch.autocast(bf16)
  hf_*                       transformers' LlamaForCausalLM of the same shape and the same recipe
                             as autocast_*: fp32 weights, bf16 autocast, sdpa attention, fused
                             AdamW, each decoder layer compiled on its own (compiling the whole
                             model makes transformers build a dense causal mask, which loses the
                             causal fused kernel and grouped-query attention)

Candidate changes (issue 40) run as variants of a row, `<row>+<variant>[+<variant>...]` (VARIANTS),
in the same run as the row they change, so each is compared with its own baseline measured
minutes apart on the same GPU:
  +reshard_never   FSDP keeps each block's gathered bf16 weights from its forward to its backward
  +float8_output   the output projection in float8 too (kept in bf16 by default)
  +auto_filter     float8.auto_filter: torchao's size filter keeps the linears too small to gain
  +fsdp_float8     float8 weights all-gathered by FSDP, scales precomputed after the optimizer step

--profile-dir DIR: each row also profiles one step (CPU ops and CUDA kernels) into
DIR/<row>.json.gz, and the summary prints where its time went (benchmarks/profiling.py's
kernel_breakdown: GEMM, float8 amax/scale/cast, attention, loss and output projection, optimizer,
elementwise/other).

--flavor takes Qwen3's dense flavors too (issue 37): its hf rows are transformers'
Qwen3ForCausalLM; `--layers` defaults there to the flavor's own depth.

Honest by construction: by default each row runs in its own process (a crash, an OOM or a
hang loses that row only), and each row is appended to the JSON-lines file --out as soon as it
is measured. Each row reports tokens/s, the SDPA backend that actually ran (from the op names
of one profiled step: flash, cudnn, efficient or math), peak allocated and reserved memory,
allocator retries (cudaMalloc retried after freeing its cache: a sign of memory pressure that
costs time) and MFU = tokens/s · (6·N + 12·L·H·Q·T) / peak bf16 FLOP/s, the formula of
components.metrics.flops_per_token (N: parameters in matmuls, L layers, H heads of size Q, T
tokens of context), for every row, float8 ones included. Ratios between rows are computed
only between rows of the same run (one run id).

Run from the repository root, after the README's install:
  python -m benchmarks.gpu_throughput --out benchmarks/results/gpu_throughput.jsonl
  python -m benchmarks.gpu_throughput --dry-run    # CPU, tiny shapes: the code end to end
  python -m benchmarks.gpu_throughput --configs bf16_compile bf16_compile+reshard_never   # an A/B pair
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "3")  # the profiler (SDPA backend probe) prints stage lines otherwise

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.benchmarks.profiling import CATEGORIES, PhaseRegions, kernel_breakdown
from weft.components.config import Optimizer
from weft.components.data import Batch
from weft.components.observe.metrics import count_parameters, device_peak_flops, flops_per_token
from weft.components.training.loss import token_loss
from weft.components.training.optim import build_optimizer
from weft.float8 import DEFAULT_MIN_DIM, Float8Options, check_float8_support
from weft.models import flavors, spec_for_args, spec_for_flavor
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import Meshes, ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize
from weft.recipe.objectives.next_token import NextToken
from weft.recipe.step import StepSetup, model_forward, train_step

REPO = Path(__file__).resolve().parent.parent
# The dense Llama, compared with transformers' LlamaForCausalLM of the same shape; Qwen3's dense
# flavors likewise against Qwen3ForCausalLM.
LLAMA, QWEN3 = spec_for_flavor("llama3_8b"), spec_for_flavor("qwen3_0_6b")
FLAVORS = sorted(name for name, args in flavors().items()
                 if spec_for_flavor(name) is LLAMA or (spec_for_flavor(name) is QWEN3 and QWEN3.experts(args) is None))
KINDS = ("bf16", "float8_tensorwise", "float8_rowwise", "autocast", "hf")
CONFIGS = tuple(f"{kind}_{mode}" for kind in KINDS for mode in ("eager", "compile"))
# The rows of a full run; bf16_compile twice, first and last, to show the run-to-run noise.
DEFAULT_CONFIGS = ("bf16_compile", "bf16_eager", "float8_tensorwise_compile", "float8_rowwise_compile",
                   "autocast_compile", "hf_compile", "bf16_compile")
TARGETS = (  # (what, row, baseline row or None for MFU, target): issue 40's
    ("bf16 + compile MFU %", "bf16_compile", None, 55.0),
    ("weft bf16 + compile (FSDP) / transformers (same recipe)", "bf16_compile", "hf_compile", 1.05),
    ("float8 tensorwise + compile / bf16 + compile", "float8_tensorwise_compile", "bf16_compile", 1.3),
    ("float8 rowwise + compile / bf16 + compile", "float8_rowwise_compile", "bf16_compile", 1.3),
)
# Candidate changes (issue 40): variant -> the row kinds it applies to.
VARIANTS = {
    "reshard_never": ("bf16", "float8_tensorwise", "float8_rowwise"),
    "float8_output": ("float8_tensorwise", "float8_rowwise"),
    "auto_filter": ("float8_tensorwise", "float8_rowwise"),
    "fsdp_float8": ("float8_tensorwise",),
}
# Names of the aten ops scaled_dot_product_attention dispatches to, by backend.
SDPA_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


@dataclass
class Row:
    """One configuration's measurements (one JSON line). status: ok, skipped or error."""

    run_id: str
    config: str
    status: str
    reason: str = ""
    tokens_per_s: float | None = None  # over the timed steps: their tokens / their total time
    median_step_s: float | None = None
    mfu_percent: float | None = None  # None where the device's peak is unknown (CPU)
    sdpa_backends: list[str] = field(default_factory=list)
    peak_allocated_gib: float | None = None  # None on CPU
    peak_reserved_gib: float | None = None
    alloc_retries: int | None = None
    warmup_step_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included (same batches every row)
    settings: dict = field(default_factory=dict)
    breakdown_ms: dict = field(default_factory=dict)  # with --profile-dir: kernel_breakdown's ms by category


def config_name(value: str) -> str:
    """A row name: one of CONFIGS, optionally followed by +variant for each VARIANTS entry it applies."""
    base, *variants = value.split("+")
    if base not in CONFIGS:
        raise argparse.ArgumentTypeError(f"{value!r}: expected one of {', '.join(CONFIGS)}, optionally +variant")
    kind = base.rsplit("_", 1)[0]
    for variant in variants:
        if kind not in VARIANTS.get(variant, ()):
            known = ", ".join(f"{v} ({'/'.join(k)})" for v, k in VARIANTS.items())
            raise argparse.ArgumentTypeError(f"{value!r}: +{variant} does not apply to {kind} rows; variants: {known}")
    return value


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --dry-run changes the defaults to tiny CPU settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="llama3_8b", choices=FLAVORS)
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: as many as fit in free GPU memory, see default_layers)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3, help="steps run before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), type=config_name,
                        help=f"rows, in order ({', '.join(CONFIGS)}, each optionally +variant: "
                             f"{', '.join(VARIANTS)}); a row named twice is measured twice")
    parser.add_argument("--profile-dir", type=Path,
                        help="profile one step of each row into DIR/<row>.json.gz and print its time by category")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--float8-min-dim", type=int, default=DEFAULT_MIN_DIM,
                        help="linear layers with a smaller dimension stay in bf16")
    parser.add_argument("--no-hf-fullgraph", dest="hf_fullgraph", action="store_false",
                        help="let transformers' compiled decoder layers break into several graphs "
                             "(if its version does not trace in one)")
    parser.add_argument("--out", type=Path, help="append each row here as one JSON line (default: a temporary file)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every row in this process, each exception caught (default: one process per row)")
    parser.add_argument("--row-timeout", type=float, default=1800, help="seconds before a row's process is killed")
    parser.add_argument("--dry-run", action="store_true",
                        help="defaults for a quick CPU check: debugmodel, 1 layer, seq-len 128, 1 warm-up + 2 "
                             "timed steps, float8-min-dim 16 (options given explicitly still win)")
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)  # set by the parent for its rows
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one row, no summary
    if parser.parse_known_args(argv)[0].dry_run:
        parser.set_defaults(device="cpu", flavor="debugmodel", layers=1, seq_len=128, warmup=1, steps=2,
                            float8_min_dim=16)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def model_shape(opts: argparse.Namespace, layers: int) -> Any:
    flavor = flavors()[opts.flavor]
    return replace(flavor, n_layers=layers, max_seq_len=max(opts.seq_len, flavor.max_seq_len))


def default_layers(model_args: Any, seq_len: int, batch_size: int, free_bytes: int,
                   headroom: float = 0.85) -> int:
    """How many blocks of this shape fit in `free_bytes` with this benchmark's recipe (at least 1).

    An estimate of the peak, without activation checkpointing, for the hungriest rows (autocast):
      each parameter  18 bytes: fp32 weight, gradient and two AdamW moments (16), and the bf16
                      copy the matmuls use, kept for backward (2)
      each block      its parameters, plus the activations saved for backward: about
                      32·dim + 4·kv_dim + 8·ffn bytes per token (fp32 residual stream and norms,
                      bf16 casts of each matmul's input, q/k/v, attention output, SwiGLU)
      once            the embedding and output parameters, plus 10 bytes per logit (bf16 logits,
                      their fp32 copy and its log-softmax)
    within `headroom` of the free memory (the rest: allocator slack, library workspaces).
    llama3_8b at seq 8192: 6 blocks on an H100 (78 GiB free), 16 on an H200 (139 GiB free).
    """
    tokens = seq_len * batch_size
    block_params, other_params = block_and_other_parameters(model_args)
    kv_dim = model_args.kv_heads * model_args.head_dim
    per_block = 18 * block_params + tokens * (32 * model_args.dim + 4 * kv_dim + 8 * model_args.ffn_hidden_dim)
    fixed = 18 * other_params + 10 * tokens * model_args.vocab_size
    return max(1, int((headroom * free_bytes - fixed) // per_block))


def block_and_other_parameters(model_args: Any) -> tuple[int, int]:
    """Parameters of one transformer block, and of everything else (embedding, final norm, output)."""
    with torch.device("meta"):
        model = LLAMA.build(replace(model_args, n_layers=1))
    block = count_parameters(model.layers["0"])
    return block, count_parameters(model) - block


# ---------------------------------------------------------------------------------------------
# Building the models
# ---------------------------------------------------------------------------------------------


def build_weft_model(model_args: Any, device: torch.device, *, meshes: Meshes | None, compile: bool,
                     float8_recipe: str | None, float8_min_dim: int, variants: tuple[str, ...] = ()) -> nn.Module:
    """The weft model as train.py builds it, through the same `parallelize`: float8, compile and,
    given a one-rank mesh, FSDP (for its bf16 mixed precision) on the meta device, then weights
    on `device`. meshes None: the plain single-device model (the autocast rows). `variants`: the
    candidate changes (VARIANTS) this row makes."""
    with torch.device("meta"):
        model = spec_for_args(model_args).build(model_args)
    float8 = None
    if float8_recipe:
        float8 = Float8Options(float8_recipe, filter_fqns=() if "float8_output" in variants else ("output",),
                               min_dim=float8_min_dim, auto_filter="auto_filter" in variants,
                               enable_fsdp_float8_all_gather="fsdp_float8" in variants)
    fsdp = FSDPOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                       reshard_after_forward="never" if "reshard_never" in variants else "default")
    parallelize(model, meshes, ParallelizeOptions(float8=float8, compile=CompileOptions() if compile else None, fsdp=fsdp))
    materialize(model, device, seed=0)
    return model


def build_hf_model(model_args: Any, device: torch.device, *, seq_len: int, compile: bool,
                   fullgraph: bool = True) -> nn.Module:
    """transformers' LlamaForCausalLM (Qwen3ForCausalLM for a Qwen3 flavor) of the same shape
    (checked by its parameter count): fp32
    weights, sdpa attention, each decoder layer compiled on its own when `compile` (in one graph,
    as weft's blocks are, unless not `fullgraph`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # The config weft exports for this shape (rotary settings included), sized for seq_len.
    spec = spec_for_args(model_args)
    fields = spec.hf.hf_config(model_args, torch.float32)
    config = AutoConfig.for_model(**{**fields, "max_position_embeddings": max(seq_len, model_args.max_seq_len),
                            "attn_implementation": "sdpa", "use_cache": False})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        n_params = count_parameters(spec.build(model_args))
    hf_params = count_parameters(model)
    if hf_params != n_params:
        raise RuntimeError(f"the transformers model has {hf_params:,} parameters, weft's {n_params:,}")
    if compile:
        for layer in model.model.layers:
            layer.compile(fullgraph=fullgraph)
    return model


# ---------------------------------------------------------------------------------------------
# Measuring one row
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_backends(step: Callable[[], None]) -> list[str]:
    """The SDPA backends one call of `step` ran, from the aten op names the profiler records
    (compiled code calls the same ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = {event.key.removeprefix("aten::") for event in prof.key_averages()}
    return sorted({backend for op, backend in SDPA_OPS.items() if op in names})


def profile_step(step: Callable[[Callable[[str], None]], None], device: torch.device, path: Path,
                 vocab_size: int) -> dict[str, float]:
    """Profile one call of `step(on_phase)` (CPU ops, and CUDA kernels on a GPU; its phases marked
    as train.py marks them) into the chrome trace `path`; its time by category
    (benchmarks/profiling.py's kernel_breakdown), with `total` and `span`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path.parent.mkdir(parents=True, exist_ok=True)
    regions = PhaseRegions()
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step(regions)
        regions.close()
        synchronize(device)
    prof.export_chrome_trace(str(path))
    breakdown = kernel_breakdown(path, vocab_size)  # the output projection's GEMMs counted with the loss
    return {**breakdown["ms"], "total": breakdown["total_ms"], "span": breakdown["span_ms"]}


def transformers_loss(logits: torch.Tensor, labels: torch.Tensor, count, grad_ranks: int = 1, *,
                      compiled: bool = False) -> torch.Tensor:
    """transformers' causal-LM loss: eager cross-entropy over fp32 logits (summed here and divided
    by the supervised count, as token_loss is, so both rows' steps optimise the same quantity)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") * grad_ranks / count


def build_config(config: str, model_args: Any, device: torch.device, meshes: Meshes | None,
                 opts: argparse.Namespace) -> StepSetup:
    """The model of one configuration in train.py's step (recipe/step.py): its forward (tokens ->
    logits; under bf16 autocast for the autocast_* and hf_* rows), its loss (weft's rows: train.py's
    `token_loss`; hf rows: transformers' own), clipping at norm 1 and fused AdamW."""
    base, *variants = config.split("+")
    kind, mode = base.rsplit("_", 1)
    compile = mode == "compile"
    if kind == "hf":
        model = build_hf_model(model_args, device, seq_len=opts.seq_len, compile=compile, fullgraph=opts.hf_fullgraph)
        forward, loss_fn = (lambda model, batch: model(input_ids=batch.inputs).logits), transformers_loss
    else:
        recipe = kind.removeprefix("float8_") if kind.startswith("float8") else None
        model = build_weft_model(model_args, device, meshes=None if kind == "autocast" else meshes,
                                 compile=compile, float8_recipe=recipe, float8_min_dim=opts.float8_min_dim,
                                 variants=tuple(variants))
        forward, loss_fn = model_forward, token_loss
    optimizer = build_optimizer(model, Optimizer(implementation="fused"))
    autocast = kind in ("hf", "autocast")
    return StepSetup(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        device=device, max_norm=1.0, compiled_loss=compile and kind != "hf", forward=forward, loss_fn=loss_fn,
        forward_context=(lambda: torch.autocast(device.type, torch.bfloat16)) if autocast else contextlib.nullcontext,
        precompute_float8="fsdp_float8" in variants, objective=NextToken(),
    )


def measure(config: str, model_args: Any, device: torch.device, meshes: Meshes | None,
            opts: argparse.Namespace, run_id: str) -> Row:
    """Build one configuration, train it, and measure it."""
    setup = build_config(config, model_args, device, meshes, opts)
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = [torch.randint(0, model_args.vocab_size, (opts.batch_size, opts.seq_len + 1), device=device,
                            generator=generator) for _ in range(2)]
    batches = [Batch(t[:, :-1], t[:, 1:]) for t in tokens]  # two batches, alternated
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    times, losses = [], []
    for i in range(opts.warmup + opts.steps):
        synchronize(device)
        start = time.perf_counter()
        result = train_step(setup, [batches[i % 2]])
        synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(result.loss.item())  # after the clock stops
    row = Row(run_id, config, "ok", warmup_step_s=times[:opts.warmup], step_s=times[opts.warmup:], losses=losses)
    row.tokens_per_s = opts.batch_size * opts.seq_len * len(row.step_s) / sum(row.step_s)
    row.median_step_s = statistics.median(row.step_s)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        row.peak_allocated_gib = stats["allocated_bytes.all.peak"] / 2**30
        row.peak_reserved_gib = stats["reserved_bytes.all.peak"] / 2**30
        row.alloc_retries = stats.get("num_alloc_retries", 0) - retries_before
    row.sdpa_backends = sdpa_backends(lambda: train_step(setup, [batches[0]]))
    if opts.profile_dir is not None:
        row.breakdown_ms = profile_step(lambda on_phase: train_step(setup, [batches[0]], on_phase=on_phase), device,
                                        opts.profile_dir / f"{config}.json.gz", model_args.vocab_size)
    peak_flops = device_peak_flops(device)
    if peak_flops is not None:
        with torch.device("meta"):
            n_params = count_parameters(spec_for_args(model_args).build(model_args))
        row.mfu_percent = 100 * row.tokens_per_s * flops_per_token(model_args, n_params, opts.seq_len) / peak_flops
    return row


def reason_to_skip(config: str, device: torch.device) -> str | None:
    """Why this configuration cannot run here, or None."""
    if config.startswith("hf") and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if config.startswith("float8"):
        try:
            check_float8_support(device.type, "nccl" if device.type == "cuda" else "gloo", recipe=config.split("_")[1],
                                 enable_fsdp_float8_all_gather="+fsdp_float8" in config)
        except ValueError as error:
            return str(error)
    return None


def release_memory(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs hold on to the model they were traced for
    if device.type == "cuda":
        torch.cuda.empty_cache()


def append_row(path: Path, row: Row) -> None:
    """One JSON line, written and flushed at once: a later crash cannot lose it."""
    with path.open("a") as out:
        out.write(json.dumps(asdict(row)) + "\n")


def run_rows_here(configs: list[str], opts: argparse.Namespace, run_id: str, layers: int) -> None:
    """Measure `configs` in this process, each exception caught: a failure loses its row only."""
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model_args = model_shape(opts, layers)
    settings = settings_of(opts, layers, device)
    meshes = None
    if any(not c.startswith(("hf", "autocast")) for c in configs):
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
        meshes = ParallelDims.resolve(world_size=1).build_mesh(device.type)
    for config in configs:
        skip = reason_to_skip(config, device)
        if skip is not None:
            row = Row(run_id, config, "skipped", reason=skip)
        else:
            try:
                row = measure(config, model_args, device, meshes, opts, run_id)
            except Exception as error:  # noqa: BLE001 - one row's failure must not cost the others
                first_line = (str(error).strip().splitlines() or [""])[0]
                reason = "out of GPU memory" if isinstance(error, torch.cuda.OutOfMemoryError) else first_line
                row = Row(run_id, config, "error", reason=f"{type(error).__name__}: {reason}"[:500])
        row.settings = settings
        append_row(opts.out, row)
        print(f"  {config}: {row.status}" + (f", {row.tokens_per_s:,.0f} tokens/s" if row.tokens_per_s else "")
              + (f" ({row.reason})" if row.reason else ""), flush=True)
        release_memory(device)


def settings_of(opts: argparse.Namespace, layers: int, device: torch.device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "flavor": opts.flavor, "layers": layers, "seq_len": opts.seq_len,
            "batch_size": opts.batch_size, "warmup": opts.warmup, "steps": opts.steps,
            "float8_min_dim": opts.float8_min_dim}


# ---------------------------------------------------------------------------------------------
# One process per row
# ---------------------------------------------------------------------------------------------


def probe_device(device_type: str) -> dict:
    """Name and free memory of GPU 0, asked in a short-lived process so this one never holds a CUDA
    context (which would take memory from the rows' processes)."""
    if device_type != "cuda":
        return {"name": "cpu", "free": None}
    code = ("import json, torch; free, total = torch.cuda.mem_get_info(0); "
            "print(json.dumps({'name': torch.cuda.get_device_name(0), 'free': free, 'total': total}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_rows_isolated(argv: list[str], opts: argparse.Namespace, run_id: str, layers: int) -> None:
    """Run each row in a process of its own (this script with --child); a row whose process dies
    without writing its line gets an error line with the exit code and the last line of stderr."""
    for config in opts.configs:
        command = [sys.executable, "-m", "benchmarks.gpu_throughput", *argv, "--child", "--configs", config,
                   "--run-id", run_id, "--out", str(opts.out), "--layers", str(layers)]
        written_before = len(read_rows(opts.out, run_id))
        try:
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=opts.row_timeout)
            failure = f"exit code {result.returncode}: " + (result.stderr.strip().splitlines() or [""])[-1]
            output = result.stdout
        except subprocess.TimeoutExpired as timeout:  # its captured output comes as bytes
            failure, output = f"killed after {opts.row_timeout:.0f} s", (timeout.stdout or b"").decode(errors="replace")
        if output.strip():
            print(output.rstrip("\n"), flush=True)
        if len(read_rows(opts.out, run_id)) == written_before:  # the process died before writing its row
            append_row(opts.out, Row(run_id, config, "error", reason=failure[:500]))
            print(f"  {config}: error ({failure[:200]})", flush=True)


# ---------------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------------


def read_rows(path: Path, run_id: str) -> list[dict]:
    """This run's rows from the JSON-lines file (other runs' lines are left alone)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("run_id") == run_id and "config" in row]


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{baseline: {config: tokens/s over the baseline's}}, between rows of one run; a repeated
    configuration counts by its first measurement."""
    first = first_measured(rows)
    return {base: {config: row["tokens_per_s"] / first[base]["tokens_per_s"] for config, row in first.items()}
            for base in ("bf16_compile", "hf_compile") if base in first}


def mfu_formula(model_args: Any, n_params: int, seq_len: int) -> str:
    """The MFU formula with this model's numbers in it."""
    a = model_args
    in_matmuls = n_params - (0 if a.tie_embeddings else a.vocab_size * a.dim)
    flops = flops_per_token(a, n_params, seq_len)
    return (f"MFU = tokens/s x (6 N + 12 L H Q T) / bf16 peak FLOP/s, float8 rows included; "
            f"N = {in_matmuls:,} parameters in matmuls, L H Q T = {a.n_layers} x {a.n_heads} x {a.head_dim} x "
            f"{seq_len}: {flops:.4g} FLOP per token")


def first_measured(rows: list[dict]) -> dict[str, dict]:
    """Each configuration's first successful row."""
    first: dict[str, dict] = {}
    for row in rows:
        if row["status"] == "ok":
            first.setdefault(row["config"], row)
    return first


def format_table(rows: list[dict]) -> str:
    """This run's rows as an aligned table; skipped and failed rows last, with their reason."""
    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    vs, first = ratios(rows), first_measured(rows)
    width = max([27] + [len(row["config"]) for row in rows])
    lines = [f"{'config':<{width}} {'tokens/s':>10} {'MFU %':>6} {'alloc GiB':>9} {'resv GiB':>8} {'retries':>7} "
             f"{'sdpa':<12} {'/bf16_compile':>13} {'/hf_compile':>11} {'/without variant':>16} {'last loss':>9}"]
    for row in rows:
        if row["status"] != "ok":
            continue
        base = [row["tokens_per_s"] / first[b]["tokens_per_s"] if b in vs else None
                for b in ("bf16_compile", "hf_compile")]
        plain = row["config"].split("+")[0]  # a candidate against the row it changes, same run
        own = row["tokens_per_s"] / first[plain]["tokens_per_s"] if "+" in row["config"] and plain in first else None
        lines.append(f"{row['config']:<{width}} {row['tokens_per_s']:>10,.0f} {num(row['mfu_percent'], '.1f'):>6} "
                     f"{num(row['peak_allocated_gib'], '.1f'):>9} {num(row['peak_reserved_gib'], '.1f'):>8} "
                     f"{num(row['alloc_retries'], 'd'):>7} {','.join(row['sdpa_backends']) or '-':<12} "
                     f"{num(base[0], '.2f'):>13} {num(base[1], '.2f'):>11} {num(own, '.3f'):>16} "
                     f"{num((row.get('losses') or [None])[-1], '.4f'):>9}")
    lines += [f"{row['config']:<{width}} {row['status']}: {row['reason']}" for row in rows if row["status"] != "ok"]
    repeats = {}
    for row in rows:
        if row["status"] == "ok":
            repeats.setdefault(row["config"], []).append(row["tokens_per_s"])
    for config, values in repeats.items():
        if len(values) > 1:
            spread = 100 * (max(values) - min(values)) / statistics.mean(values)
            lines.append(f"{config} measured {len(values)} times: spread {spread:.1f}% of the mean")
    return "\n".join(lines)


def format_breakdowns(rows: list[dict]) -> str:
    """The profiled rows' step time by category (ms; --profile-dir), one line per row, or ''."""
    profiled = [row for row in rows if row["status"] == "ok" and row.get("breakdown_ms")]
    if not profiled:
        return ""
    width = max(len(row["config"]) for row in profiled)
    names = [c.split(" ")[0].replace("elementwise/other", "other") for c in CATEGORIES]
    lines = ["time of one profiled step by category, ms (kernels on a GPU, CPU ops' self time on a CPU):",
             f"{'config':<{width}} " + " ".join(f"{n:>10}" for n in names) + f" {'total':>10} {'span':>10}"]
    for row in profiled:
        ms = row["breakdown_ms"]
        lines.append(f"{row['config']:<{width}} " + " ".join(f"{ms[c]:>10.2f}" for c in CATEGORIES)
                     + f" {ms['total']:>10.2f} {ms['span']:>10.2f}")
    return "\n".join(lines)


def format_targets(rows: list[dict]) -> str:
    """Issue 40's targets, each with the value this run measured."""
    first = first_measured(rows)
    lines = []
    for what, config, base, target in TARGETS:
        if config not in first or (base is not None and base not in first):
            lines.append(f"target {what} >= {target}: not measured")
            continue
        if base is None:
            value = first[config]["mfu_percent"]
        else:
            value = first[config]["tokens_per_s"] / first[base]["tokens_per_s"]
        verdict = "n/a" if value is None else ("met" if value >= target else "MISSED")
        lines.append(f"target {what} >= {target}: {'-' if value is None else f'{value:.2f}'} ({verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    run_id = opts.run_id or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    if opts.out is None:
        opts.out = Path(tempfile.mkdtemp()) / "gpu_throughput.jsonl"
    opts.out = opts.out.resolve()  # the rows' processes run in the repository root
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    if opts.child:
        run_rows_here(opts.configs, opts, run_id, opts.layers)
        return
    device = probe_device(opts.device)
    layers = opts.layers
    if layers is None and opts.flavor not in LLAMA.flavors:  # Qwen3: the flavor's own depth
        layers = flavors()[opts.flavor].n_layers
    if layers is None:
        free = device["free"]
        if free is None:
            raise SystemExit("--layers is needed on CPU (no free GPU memory to size the model by)")
        layers = default_layers(LLAMA.flavors[opts.flavor], opts.seq_len, opts.batch_size, free)
        print(f"--layers {layers}: what fits in {free / 2**30:.1f} GiB free (see default_layers)")
    model_args = model_shape(opts, layers)
    with torch.device("meta"):
        n_params = count_parameters(spec_for_args(model_args).build(model_args))
    print(f"{device['name']}: {opts.flavor} with {layers} layers ({n_params:,} parameters), batch {opts.batch_size} "
          f"x seq {opts.seq_len}, {opts.warmup} warm-up + {opts.steps} timed steps; run {run_id}, rows -> {opts.out}")
    print(mfu_formula(model_args, n_params, opts.seq_len))
    if opts.in_process:
        run_rows_here(opts.configs, opts, run_id, layers)
    else:
        run_rows_isolated(argv, opts, run_id, layers)
    rows = read_rows(opts.out, run_id)
    with opts.out.open("a") as out:  # the ratios, from this run's rows only
        out.write(json.dumps({"run_id": run_id, "ratios": ratios(rows)}) + "\n")
    print(format_table(rows))
    breakdowns = format_breakdowns(rows)
    if breakdowns:
        print(breakdowns)
    print(format_targets(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
