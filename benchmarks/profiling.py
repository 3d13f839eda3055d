"""What does [profiling] cost the steps it does not profile? Prints their step-time ratio, on / off.

One process builds train.py's plan, model, optimizer and step (recipe/plan.py, build.py, step.py)
once, then runs passes of `--steps` steps of train_step, each wrapped as train.py wraps it
(components/observe/profiling.py's StepProfiler, its on_phase hook passed to train_step): with profiling
off, then on (a window of --warmup + --active steps every --freq steps, traces written to a
temporary folder). Passes alternate (off, on, off, on, ...) so drift in the machine's speed hits
both alike. Each step's train_step is timed; with profiling on only the steps outside a window
count, the steps the log's throughput counts (train.py leaves the windows and the profiler's
bookkeeping out of it).

    OMP_NUM_THREADS=2 python benchmarks/profiling.py                    # debug model on CPU
    python benchmarks/profiling.py --flavor llama3_1b --seq-len 2048 --batch 1   # on a GPU

Target: ratio <= 1.02 (the profiler costs nothing measurable outside its windows).

It also reads traces (issue 40): `kernel_breakdown` sums a trace's time by category (GEMM, float8
amax/scale/cast, attention, loss, optimizer, elementwise/other): GPU kernel time where the trace has
kernels, else CPU ops' self time. `--breakdown TRACE...` prints the table of each trace ([profiling]'s
rank-R.json.gz, or any torch.profiler chrome trace; `--vocab-size` moves the output projection's GEMMs
to the loss where the trace has shapes):

    python benchmarks/profiling.py --breakdown outputs/debug_model/profile_traces/step-10/rank-0.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerAction

from weft.components.config import Profiling, parse_args
from weft.components.data import Batch
from weft.components.observe.metrics import MetricsLogger
from weft.components.observe.profiling import PHASE_REGIONS, StepProfiler, schedule_args
from weft.models import flavors
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import StepSetup, train_step


def build_setup(flavor: str, seq_len: int, batch: int, device: torch.device) -> tuple[StepSetup, RunPlan]:
    """train.py's plan, model, optimizer and step for this shape, in one process."""
    cfg = parse_args(["--job.config_file", "debug_model", "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                      "--training.local_batch_size", str(batch)])
    plan = RunPlan.from_config(cfg, 1, device_type=device.type, writes_dump_folder=False)  # measures, writes nothing
    return build_trainer(plan, None, device).step, plan


def timed_pass(setup: StepSetup, batch: Batch, cfg: Profiling, steps: int, dump: Path) -> dict[int, float]:
    """Seconds of each step's train_step, steps 1..steps, under a StepProfiler of `cfg`."""
    metrics = MetricsLogger(device=setup.device, flops_per_token=1.0, tokens_per_step=1, world_size=1,
                            tb_folder=None, jsonl_path=None)
    profiler = StepProfiler(cfg, dump, setup.device.type, 0, metrics)
    seconds = {}
    for step in range(1, steps + 1):
        with profiler.step(step):
            start = time.perf_counter()
            result = train_step(setup, [batch], on_phase=profiler.on_phase)
            result.loss.item()  # the step's kernels done
            seconds[step] = time.perf_counter() - start
    profiler.close()
    return seconds


# ---- what a trace's time went to ---------------------------------------------------------------

CATEGORIES = ("GEMM", "float8 amax/scale/cast", "attention", "loss/output projection", "optimizer", "elementwise/other")
LOSS = "loss/output projection"
# Matched against lower-cased kernel / op names; heuristics for the names of torch's ops, cuBLAS's,
# CUTLASS's and cuDNN's kernels and inductor's fused kernels (named after the ops they fuse).
_ATTENTION = r"flash|fmha|attention|sdpa|scaled_dot_product"
_GEMM = r"gemm|cutlass|nvjet|xmma|cublas|wgmma|(^|[^a-z])(mm|addmm|bmm|baddbmm|scaled_mm|grouped_mm)([^a-z]|$)"
_LOSS = r"cross_?entropy|log_softmax|logsumexp|nll_loss"
_FLOAT8 = r"float8|e4m3|e5m2|amax|abs_max|fused_abs|_to_copy_clamp|clamp_[a-z_]*to_copy"
_OPTIMIZER = r"^optimizer$|adam|clip_grad"  # the optimizer phase's region (train_step's on_phase), its ops
_FIRST = (("attention", _ATTENTION), ("GEMM", _GEMM))  # own name: cuDNN attention names wgmma too
_ENCLOSED = (("attention", _ATTENTION), (LOSS, _LOSS), ("float8 amax/scale/cast", _FLOAT8))
_THEN = ((LOSS, _LOSS), ("float8 amax/scale/cast", _FLOAT8), ("optimizer", r"adam|multi_tensor_apply|foreach"))
_HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def category(name: str, enclosing: list[str]) -> str:
    """The category of a kernel or op called `name`, launched inside `enclosing` ops and regions
    (innermost first): everything in the optimizer phase is optimizer; then a GEMM or attention
    kernel by its own name; then what encloses it (attention, else loss, else float8);
    then its own name again; else elementwise/other."""
    name, enclosing = name.lower(), [n.lower() for n in enclosing]
    if any(re.search(_OPTIMIZER, n) for n in enclosing):
        return "optimizer"
    for cat, pattern in _FIRST:
        if re.search(pattern, name):
            return cat
    for cat, pattern in _ENCLOSED:  # in this order: a fill inside an amax inside a logsumexp is the loss's
        if any(re.search(pattern, n) for n in enclosing):
            return cat
    for cat, pattern in _THEN:
        if re.search(pattern, name):
            return cat
    return "elementwise/other"


class PhaseRegions:
    """train_step's on_phase marking the phases as train.py's traces do (record_function regions
    forward, backward, optimizer; components/observe/profiling.py), so kernel_breakdown sees the optimizer
    phase. `close()` ends the last region."""

    def __init__(self) -> None:
        self._open = None

    def __call__(self, phase: str) -> None:
        self.close()
        self._open = torch.profiler.record_function(PHASE_REGIONS[phase])
        self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


def trace_events(trace) -> list[dict]:
    """The complete events of a chrome trace: a path (.json or .json.gz) or a torch.profiler.profile
    (torch exports a profile once: its events are kept on it for later calls)."""
    if isinstance(trace, torch.profiler.profile):
        if not hasattr(trace, "_weft_events"):
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "trace.json"
                trace.export_chrome_trace(str(path))
                trace._weft_events = trace_events(path)
        return trace._weft_events
    path = Path(trace)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _parents(events: list[dict]) -> dict[int, dict | None]:
    """Each host event's enclosing event on its thread (by id()), from the intervals' nesting."""
    parent: dict[int, dict | None] = {}
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in threads.values():
        stack: list[dict] = []
        for e in sorted(thread, key=lambda e: (e["ts"], -e.get("dur", 0))):
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < e["ts"] + e.get("dur", 0):
                stack.pop()
            parent[id(e)] = stack[-1] if stack else None
            stack.append(e)
    return parent


def kernel_breakdown(trace, vocab_size: int | None = None) -> dict:
    """Where a profiled step's time went, by CATEGORIES.

    trace: a chrome trace path (weft's [profiling] rank-R.json.gz) or a torch.profiler.profile.
    GPU traces: every kernel, memcpy and memset's device time; a kernel is categorised by its name,
    then by the host ops and regions enclosing its launch (linked by the correlation id; the
    optimizer phase's region takes all its kernels). CPU traces (no kernels): each CPU op's self
    time (its time minus its child ops'), categorised the same way. The name patterns are
    heuristics for torch's, cuBLAS/cuDNN's and inductor's names: look at `top` for what lands in
    elementwise/other. `vocab_size`: a GEMM launched by an op with a dimension of that size is the
    output projection's (or its gradients'), counted with the loss; needs the trace's shapes
    (record_shapes, `[profiling] record_shapes`). Returns {"source": "kernels" | "cpu ops", "total_ms", "span_ms" (first
    start to last end), "ms": {category: ms}, "top": [(ms, category, name), ...] (20 largest)}.
    """
    events = trace_events(trace)
    host = [e for e in events if e.get("cat") in _HOST_CATS]
    parent = _parents(host)

    def enclosing(e: dict | None) -> list[dict]:
        chain = []
        while e is not None:
            chain.append(e)
            e = parent.get(id(e))
        return chain

    def has_vocab_dim(chain: list[dict]) -> bool:
        return vocab_size is not None and any(
            vocab_size in (d for dims in e.get("args", {}).get("Input Dims", []) if isinstance(dims, list) for d in dims)
            for e in chain)

    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    timed: list[tuple[float, str, list[dict], list[dict]]] = []  # (us, name, enclosing, where to look for shapes)
    if device:
        source = "kernels"
        launches = {e["args"]["correlation"]: e for e in host
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        for k in device:
            launch = launches.get(k.get("args", {}).get("correlation"))
            chain = enclosing(launch)
            timed.append((k.get("dur", 0), k["name"], chain, chain))
        span = max(e["ts"] + e.get("dur", 0) for e in device) - min(e["ts"] for e in device)
    else:
        source = "cpu ops"
        ops = [e for e in host if e.get("cat") == "cpu_op"]
        children: dict[int, float] = {}
        for e in ops:
            up = parent.get(id(e))
            while up is not None and up.get("cat") != "cpu_op":  # a region between op and child op
                up = parent.get(id(up))
            if up is not None:
                children[id(up)] = children.get(id(up), 0.0) + e.get("dur", 0)
        timed = []
        for e in ops:
            chain = enclosing(parent.get(id(e)))
            timed.append((e.get("dur", 0) - children.get(id(e), 0.0), e["name"], chain, [e, *chain]))
        span = (max(e["ts"] + e.get("dur", 0) for e in ops) - min(e["ts"] for e in ops)) if ops else 0.0
    ms = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], float] = {}
    for us, name, outer, shaped in timed:
        cat = category(name, [e["name"] for e in outer])
        if cat == "GEMM" and has_vocab_dim(shaped):
            cat = LOSS
        ms[cat] += us / 1e3
        by_name[(cat, name)] = by_name.get((cat, name), 0.0) + us / 1e3
    top = sorted(((t, cat, name) for (cat, name), t in by_name.items()), reverse=True)[:20]
    return {"source": source, "total_ms": sum(ms.values()), "span_ms": span / 1e3, "ms": ms, "top": top}


def format_breakdown(breakdown: dict, title: str = "", top: int = 8) -> str:
    """The breakdown as a table: ms and share of the total per category, then the largest names."""
    total = breakdown["total_ms"] or 1.0
    lines = [f"{title}{breakdown['source']}: {breakdown['total_ms']:.2f} ms in all over a span of "
             f"{breakdown['span_ms']:.2f} ms", f"  {'category':<24} {'ms':>10} {'share':>7}"]
    lines += [f"  {cat:<24} {t:>10.2f} {100 * t / total:>6.1f}%" for cat, t in breakdown["ms"].items()]
    lines += [f"  top: {t:8.2f} ms  {cat:<22} {name[:110]}" for t, cat, name in breakdown["top"][:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--breakdown", nargs="+", type=Path, metavar="TRACE",
                        help="print each trace's time by category (kernel_breakdown) and exit")
    parser.add_argument("--vocab-size", type=int, help="with --breakdown: count GEMMs with a dimension of this size "
                        "(the output projection's; needs shapes in the trace) with the loss")
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(flavors()))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="steps per pass")
    parser.add_argument("--freq", type=int, default=10, help="profiling.freq of the passes with profiling on")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--active", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="passes of each kind")
    args = parser.parse_args()
    if args.breakdown:
        for trace in args.breakdown:
            print(format_breakdown(kernel_breakdown(trace, args.vocab_size), f"{trace}: "))
        return

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup, plan = build_setup(args.flavor, args.seq_len, args.batch, device)
    tokens = torch.randint(0, plan.model_args.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:]).to(device)
    for _ in range(3):  # optimizer state, allocator and caches settle
        train_step(setup, [batch])

    on = Profiling(enable=True, freq=args.freq, warmup=args.warmup, active=args.active)
    schedule = torch.profiler.schedule(**schedule_args(args.freq, args.warmup, args.active))
    outside = [step for step in range(1, args.steps + 1) if schedule(step) == ProfilerAction.NONE]
    off_s, on_s, profiled_s = [], [], []
    with tempfile.TemporaryDirectory() as dump:
        for repeat in range(args.repeats):
            off_s += list(timed_pass(setup, batch, Profiling(), args.steps, Path(dump) / f"off-{repeat}").values())
            seconds = timed_pass(setup, batch, on, args.steps, Path(dump) / f"on-{repeat}")
            on_s += [seconds[step] for step in outside]
            profiled_s += [seconds[step] for step in seconds if step not in outside]
        traces = len(list(Path(dump).rglob("*.json.gz")))

    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {name}; model {args.flavor}, batch {args.batch} x seq {args.seq_len}, {args.steps} steps per pass, "
          f"{args.repeats} passes each; on: a window of {args.warmup} + {args.active} steps every {args.freq} "
          f"({traces} traces written)")
    off_ms, on_ms = 1000 * statistics.median(off_s), 1000 * statistics.median(on_s)
    print(f"step time off:                      median {off_ms:.2f} ms over {len(off_s)} steps")
    print(f"step time on, steps outside windows: median {on_ms:.2f} ms over {len(on_s)} steps")
    if profiled_s:
        print(f"step time on, steps inside windows:  median {1000 * statistics.median(profiled_s):.2f} ms "
              f"over {len(profiled_s)} steps (left out of the log's throughput)")
    ratio = on_ms / off_ms
    verdict = "met" if ratio <= 1.02 else "NOT met"
    print(f"ratio on / off (steps outside windows): {ratio:.3f}  (target <= 1.02: {verdict})")


if __name__ == "__main__":
    main()
