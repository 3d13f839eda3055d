"""The training loss: mean cross-entropy over the supervised tokens of the whole global batch.

With loss masks (chat, prompt/completion) micro-batches and ranks hold different numbers of
supervised tokens. Averaging per-rank or per-micro-batch means would weight a token of a short
answer more than one of a long answer, and would change with the layout. Instead every token
counts once: each step first counts the supervised tokens of all its micro-batches on all
data- and context-parallel ranks (one all-reduce, before any backward), and each micro-batch's
loss is its *sum* of token losses divided by that global count.

Gradients are averaged (not summed) over the data- and context-parallel ranks by FSDP / DDP and
by the CP recipe, so each rank scales its loss by their number, `grad_ranks`: the averaged
gradient is then exactly the gradient of sum(all token losses) / global count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "global_supervised_count", "token_loss"]


def global_supervised_count(labels: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Supervised tokens (labels != IGNORE_INDEX) in these micro-batches, summed over `group`'s ranks.

    A float tensor on the labels' device, never read on the host: the step does not wait for it."""
    count = sum((lab != IGNORE_INDEX).sum() for lab in labels).to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count.clamp(min=1.0)  # a step with no supervised token contributes nothing, not NaN


def token_loss(logits: torch.Tensor, labels: torch.Tensor, global_count: torch.Tensor | float,
               grad_ranks: int = 1) -> torch.Tensor:
    """Sum of this micro-batch's token losses / global supervised count, × grad_ranks (see module doc).

    logits [batch, seq, vocab] (a vocabulary-sharded DTensor under loss parallel); labels [batch, seq].
    """
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    scale = grad_ranks / torch.as_tensor(global_count, dtype=torch.float32, device=labels.device)
    if isinstance(total, DTensor):  # loss parallel: the scale joins the replicated loss as a DTensor too
        scale = DTensor.from_local(scale, total.device_mesh, [Replicate()] * total.device_mesh.ndim, run_check=False)
    return total * scale
