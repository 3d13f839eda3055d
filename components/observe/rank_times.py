"""Slow ranks: every rank's step time and data wait, gathered at each log step, and the rank that
holds the others back.

Ranks in synchronous training take the same wall time per step, so a rank's own step time is
estimated from the data wait, the part timed on every rank without instrumenting collectives:

    own[r] = min over ranks of (step - data wait)  +  data_wait[r]

The slowest rank has the largest own time, reported with its ratio to the median's (docs/observability.md).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from weft.components.distributed.processes import is_fake_distributed

# Per-rank scalars (ranks/<figure>/<rank>) are written for worlds up to this size; bigger worlds get
# only the max, median and argmax of each figure, so metrics.jsonl and TensorBoard stay small.
RANKS_LISTED_UP_TO = 64

# torch 2.13 names all_gather_into_tensor all_gather_single (and deprecates the old name)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_rank_times(step_seconds: float, data_wait_seconds: float, device: torch.device) -> torch.Tensor:
    """[world_size, 2] tensor of every rank's (step seconds, data wait seconds), in rank order, from
    one all-gather over the default group; this rank's alone without a (real) process group.
    Every rank must call it at the same steps."""
    mine = torch.tensor([step_seconds, data_wait_seconds], dtype=torch.float64)
    if not dist.is_initialized() or is_fake_distributed() or dist.get_world_size() == 1:
        return mine.unsqueeze(0)
    mine = mine.to(gather_device(dist.get_backend(), device))
    gathered = mine.new_empty(dist.get_world_size() * 2)
    _ALL_GATHER(gathered, mine)
    return gathered.view(-1, 2).cpu()


def gather_device(collectives: str, device: torch.device) -> torch.device:
    """Where the gathered tensor lives: the GPU under NCCL alone (it gathers only CUDA tensors);
    the CPU under gloo (share_gpus too) and "cuda:nccl,cpu:gloo" (gloo takes CPU tensors)."""
    return device if collectives == "nccl" else torch.device("cpu")


def slowest_rank(times: torch.Tensor) -> tuple[int, float]:
    """The rank with the largest own step time (see the module) and that time over the median
    rank's; (0, 1.0) for a world of one."""
    step, wait = times[:, 0].tolist(), times[:, 1].tolist()
    compute = min(s - w for s, w in zip(step, wait))
    own = [compute + w for w in wait]
    rank = max(range(len(own)), key=own.__getitem__)
    median = statistics.median(own)
    return rank, (own[rank] / median if median > 0 else 1.0)


def rank_scalars(times: torch.Tensor, listed_up_to: int = RANKS_LISTED_UP_TO) -> dict[str, float]:
    """The scalars of the gathered times: ranks/step_seconds/<r> and ranks/data_wait_seconds/<r>
    per rank (for worlds up to `listed_up_to`), and always /max, /median, /argmax of each, and
    ranks/slowest_rank with ranks/slowest_ratio (see slowest_rank)."""
    values: dict[str, float] = {}
    for column, figure in enumerate(("step_seconds", "data_wait_seconds")):
        per_rank = times[:, column].tolist()
        if len(per_rank) <= listed_up_to:
            values.update({f"ranks/{figure}/{r}": v for r, v in enumerate(per_rank)})
        argmax = max(range(len(per_rank)), key=per_rank.__getitem__)
        values.update({f"ranks/{figure}/max": per_rank[argmax], f"ranks/{figure}/median": statistics.median(per_rank),
                       f"ranks/{figure}/argmax": argmax})
    values["ranks/slowest_rank"], values["ranks/slowest_ratio"] = slowest_rank(times)
    return values


def slow_rank_note(times: torch.Tensor, threshold: float) -> str:
    """`slowest_rank R xF` for the log line when F exceeds threshold (> 0), else ''."""
    if threshold <= 0 or len(times) < 2:
        return ""
    rank, ratio = slowest_rank(times)
    return f"  slowest_rank {rank} x{ratio:.2f}" if ratio > threshold else ""
