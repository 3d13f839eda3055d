"""Training metrics: FLOPs per token, MFU, throughput, memory, slow ranks and time left, logged and
written to metrics.jsonl, TensorBoard and (optionally) Weights & Biases."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from weft.components.observe.rank_times import gather_rank_times, rank_scalars, slow_rank_note
from weft.components.observe.time_left import TimeLeft, clock
from weft.layers.nf4_experts import weight_numel
from weft.models import spec_for_args, spec_for_model

logger = logging.getLogger("weft")

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, by the words of torch.cuda.get_device_name()
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"): a key matches a run of whole words, so
# "GB200" is not a B200, nor "L40" an L4. The first match wins: more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU with this name (as CUDA reports it), or None if not in the table."""
    words = re.split(r"[\s\-_]+", device_name.upper())
    for key, peak in PEAK_BF16_FLOPS:
        wanted = key.upper().split()
        if any(words[i:i + len(wanted)] == wanted for i in range(len(words))):
            return peak
    return None


def count_parameters(model: torch.nn.Module) -> int:
    """Parameters of the full (unsharded) model; shared (tied) parameters count once; NF4 experts
    as the weights they hold."""
    return weight_numel(model)


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token uses: all of a dense model's; a Mixture of Experts' less the routed
    experts a token is not sent to (its spec's `active_parameters`)."""
    spec = spec_for_model(model)
    if spec is None or spec.active_parameters is None:
        return count_parameters(model)
    return spec.active_parameters(model)


def flops_per_token(args: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token of the model `args` describe, with `n_params` parameters in use
    (`active_parameters`):
    its family's formula (`ModelSpec.flops_per_token`; Llama's is 6·N + 12·L·H·Q·T)."""
    return spec_for_args(args).flops_per_token(args, n_params, seq_len)


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (MFU is then reported as unavailable)."""
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def reset_peak_memory(device: torch.device) -> None:
    """Start the CUDA allocator's peak afresh (start-up's transient buffers are not the training
    loop's); the CPU's peak resident size cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    skipped_steps: int = 0  # optimizer steps skipped so far for a non-finite loss or gradient norm
    moe_imbalance: dict[str, float] = field(default_factory=dict)  # MoE layer -> busiest expert's load / mean
    ep_imbalance: dict[str, float] = field(default_factory=dict)  # MoE layer -> tokens of the busiest ep rank / mean
    source_tokens: dict[str, int] = field(default_factory=dict)  # data.mixture source -> tokens drawn so far
    groups: Any = None  # [fault_tolerance]: components.ft.GroupStats (groups in the step, uncommitted steps, heal time)
    objective: dict[str, float] = field(default_factory=dict)  # the objective's scalars (preference: TRL's rewards/...)
    objective_note: str = ""  # what the log line shows of them ("  reward_margin 0.0012  reward_accuracy 0.750")


class MetricsLogger:
    """Every `log_freq` steps: one log line, TensorBoard scalars and a JSON line in metrics.jsonl
    (and the same scalars to Weights & Biases when `wandb` is given).

    Throughput excludes `untimed()` blocks (validation, saves) and `untimed_step()` steps (profiled);
    the CUDA memory peak counts from construction. Only the rank given folders writes, from the first
    `log` on. A resume at `start_step` keeps metrics.jsonl's and TensorBoard's records up to it, so
    each step has one record. Every rank calls `log` at the same steps: it gathers the ranks' step
    times and data waits in one collective (rank_times.py) and names the slowest rank when its ratio
    to the median exceeds `slow_rank_threshold` (0: never). `last_step`: the run's final step.
    """

    def __init__(self, *, device: torch.device, flops_per_token: float, tokens_per_step: int,
                 world_size: int, tb_folder: Path | None, jsonl_path: Path | None, start_step: int = 0,
                 last_step: int = 0, slow_rank_threshold: float = 0.0, wandb: Any = None):
        self.device = device
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step  # global
        self.world_size = world_size
        self.peak_flops = device_peak_flops(device)
        self.tb_folder, self.jsonl_path, self.start_step = tb_folder, jsonl_path, start_step
        self.slow_rank_threshold, self.wandb = slow_rank_threshold, wandb
        self.writer = None
        self.jsonl = None
        self._opened = False
        self.time_left = TimeLeft(start_step, last_step)
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._untimed_s = 0.0
        self._untimed_steps = 0
        self._data_wait_s = 0.0
        reset_peak_memory(device)

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave what runs inside (validation, a checkpoint save) out of the throughput window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._untimed_s += time.perf_counter() - start

    @contextlib.contextmanager
    def untimed_step(self) -> Iterator[None]:
        """Leave the training step run inside (a profiled one) out of the throughput window: its
        time and its tokens. A window of untimed steps only logs tokens/s as nan."""
        self._untimed_steps += 1
        with self.untimed():
            yield

    def _open(self) -> None:
        """Open the outputs at the first log, dropping records after start_step (see the class)."""
        self._opened = True
        if self.tb_folder is not None:

            self.writer = SummaryWriter(log_dir=str(self.tb_folder), purge_step=self.start_step + 1)
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            if self.jsonl_path.exists():
                _keep_records_up_to(self.jsonl_path, self.start_step)
            self.jsonl = self.jsonl_path.open("a")

    def next_batches(self, loader: Iterator, n: int) -> list:
        """The next `n` micro-batches of `loader`, the time spent waiting for them counted as data wait."""
        start = time.perf_counter()
        try:
            return [next(loader) for _ in range(n)]
        finally:
            self._data_wait_s += time.perf_counter() - start

    def step_done(self) -> None:
        self._window_steps += 1

    def log(self, stats: StepStats) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels are part of its steps' time
        elapsed = time.perf_counter() - self._window_start - self._untimed_s
        timed_steps = self._window_steps - self._untimed_steps
        tokens_per_second = (self.tokens_per_step * timed_steps / elapsed / self.world_size  # per device
                             if timed_steps else math.nan)
        # Per step: the timed steps' time, and the data wait of every step of the window.
        times = gather_rank_times(elapsed / timed_steps if timed_steps else math.nan,
                                  self._data_wait_s / max(self._window_steps, 1), self.device)
        run_seconds, remaining_seconds = self.time_left.at_log(stats.step)
        values = {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/skipped_steps": stats.skipped_steps,
            "train/tokens_per_second": tokens_per_second,
            "memory/peak_gib": peak_memory_gib(self.device),
            **{f"moe/imbalance/{layer}": value for layer, value in stats.moe_imbalance.items()},
            **{f"moe/ep_imbalance/{layer}": value for layer, value in stats.ep_imbalance.items()},
            **{f"data/tokens/{name}": tokens for name, tokens in stats.source_tokens.items()},
            **(stats.groups.scalars() if stats.groups else {}),
            **stats.objective,
            "time/elapsed_seconds": run_seconds,
            "time/remaining_seconds": remaining_seconds,
            **rank_scalars(times),
        }
        if not self._opened:
            self._open()
        mfu = "n/a"
        if self.peak_flops is not None:
            values["train/mfu"] = 100 * tokens_per_second * self.flops_per_token / self.peak_flops
            mfu = f"{values['train/mfu']:.1f}%"
        logger.info(
            f"step {stats.step:>6}  loss {stats.loss:8.4f}  grad_norm {stats.grad_norm:8.4f}  lr {stats.lr:.3e}  "
            f"tokens/s/device {tokens_per_second:,.0f}  mfu {mfu}  peak_memory {values['memory/peak_gib']:.2f} GiB"
            + (f"  skipped_steps {stats.skipped_steps}" if stats.skipped_steps else "")
            + (f"  moe_imbalance {max(stats.moe_imbalance.values()):.2f}" if stats.moe_imbalance else "")
            + (f"  ep_imbalance {max(stats.ep_imbalance.values()):.2f}" if stats.ep_imbalance else "")
            + source_note(stats.source_tokens)
            + stats.objective_note
            + (f"  {stats.groups.note()}" if stats.groups else "")
            + slow_rank_note(times, self.slow_rank_threshold)
            + f"  elapsed {clock(run_seconds)} eta {clock(remaining_seconds)}"
        )
        self._write(values, stats.step)
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._untimed_s = 0.0
        self._untimed_steps = 0
        self._data_wait_s = 0.0
        return values

    def log_validation(self, step: int, losses: dict[str, float], scalars: dict[str, float] | None = None,
                       note: str = "") -> dict[str, float]:
        """Validation losses by source ('': validation.dataset_path's one loss) and their perplexities:
        a log line, TensorBoard scalars, a JSON line. An objective's `scalars` (preference: its rewards)
        go with its one loss as validation/<name>, with no perplexity; `note` is their part of the line."""
        if scalars is not None:  # online RL has no validation loss, only its scalars (rewards)
            loss = {"validation/loss": losses[""]} if "" in losses else {}
            values = {**loss, **{f"validation/{k}": v for k, v in scalars.items()}}
            logger.info(f"step {step:>6}  validation" + (f" loss {losses['']:8.4f}" if loss else "") + note)
            if not self._opened:
                self._open()
            self._write(values, step)
            return values
        values, parts = {}, []
        for name, loss in losses.items():
            suffix = f"/{name}" if name else ""
            values[f"validation/loss{suffix}"] = loss
            values[f"validation/perplexity{suffix}"] = perplexity = math.exp(min(loss, 80.0))
            parts.append(f"{name + ' ' if name else ''}{loss:8.4f}  perplexity {perplexity:.2f}")
        logger.info(f"step {step:>6}  validation loss " + "  ".join(parts))
        if not self._opened:
            self._open()
        self._write(values, step)
        return values

    def _write(self, values: dict[str, float], step: int) -> None:
        """The same scalars at the same step to TensorBoard, metrics.jsonl and wandb (those this rank has)."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(values, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.close()


def source_note(tokens: dict[str, int]) -> str:
    """The log line's tokens drawn from each source of a data.mixture, with its share ('' without one)."""
    total = sum(tokens.values())
    if not total:
        return ""
    return "  source_tokens " + " ".join(f"{name} {_count(n)} ({100 * n / total:.1f}%)" for name, n in tokens.items())


def _count(n: int) -> str:
    """1234 -> '1.2k', 5600000 -> '5.6M' (for the log line; metrics.jsonl holds the exact counts)."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the records of steps after `step` (atomically: by rename).
    A line that is not a record (a write cut by a crash) is dropped."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(kept))
    partial.replace(path)
