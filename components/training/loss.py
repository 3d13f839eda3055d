"""The training loss: mean cross-entropy over the supervised tokens of the whole global batch.

Each step counts the supervised tokens of all its micro-batches on all data- and context-parallel
ranks (one all-reduce, before backward); each micro-batch's loss is its sum of token losses over
that count, scaled by `grad_ranks` since FSDP / DDP / CP average gradients, so every token counts
once whatever the layout. The fp32 cross-entropy never holds fp32 logits whole:
`compiled_cross_entropy` when compiled, `chunked_cross_entropy` otherwise. Why, and what each
costs (benchmarks/loss_memory.py): docs/memory.md and docs/fine-tuning.md.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

IGNORE_INDEX = -100

# fp32 working memory of one chunk of chunked_cross_entropy: rows × vocab × 4 bytes stay below this.
CHUNK_BYTES = 256 * 2**20

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "compiled_cross_entropy", "global_supervised_count",
           "token_loss"]


def global_supervised_count(labels: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Supervised tokens (labels != IGNORE_INDEX) in these micro-batches, summed over `group`'s ranks.

    A float tensor on the labels' device, never read on the host: the step does not wait for it."""
    count = sum((lab != IGNORE_INDEX).sum() for lab in labels).to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count.clamp(min=1.0)  # a step with no supervised token contributes nothing, not NaN


def token_loss(logits: torch.Tensor, labels: torch.Tensor, global_count: torch.Tensor | float,
               grad_ranks: int = 1, *, compiled: bool = False) -> torch.Tensor:
    """Sum of this micro-batch's token losses / global supervised count, × grad_ranks (see module doc).

    logits [batch, seq, vocab] (a vocabulary-sharded DTensor under loss parallel); labels [batch, seq].
    `compiled`: use the torch.compile'd cross-entropy, else the chunked eager one.
    """
    logits, labels = logits.flatten(0, 1), labels.flatten()
    if isinstance(logits, DTensor):  # loss parallel: DTensor's cross-entropy reduces over the vocab shards
        total = _fp32_cross_entropy(logits, labels)
    elif compiled:
        total = compiled_cross_entropy(logits, labels)
    else:
        total = chunked_cross_entropy(logits, labels)
    scale = grad_ranks / torch.as_tensor(global_count, dtype=torch.float32, device=labels.device)
    if isinstance(total, DTensor):  # the scale joins the replicated loss as a DTensor too
        scale = DTensor.from_local(scale, total.device_mesh, [Replicate()] * total.device_mesh.ndim, run_check=False)
    return total * scale


def _fp32_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


@functools.cache
def _compiled_fp32_cross_entropy():
    return torch.compile(_fp32_cross_entropy)


def compiled_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")` through
    torch.compile (inductor): the fp32 upcast happens inside the fused kernels, which read the logits
    once per pass and keep one log-sum-exp per row for backward. Compiled once per process, on the
    first call (again if the shape changes)."""
    return _compiled_fp32_cross_entropy()(logits, labels)


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Sum over rows of -log softmax(logits)[label] in fp32, skipping labels equal to IGNORE_INDEX.

    logits [N, vocab] in any float dtype, labels [N]. Equal to `F.cross_entropy(logits.float(),
    labels, ignore_index=IGNORE_INDEX, reduction="sum")`, but the fp32 values exist only for
    `chunk_rows` rows at a time (default: CHUNK_BYTES of them): forward keeps one log-sum-exp per
    row, and backward recomputes the softmax chunk by chunk, writing the gradient straight into
    the logits' dtype.
    """
    rows = chunk_rows or max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
    return _ChunkedCrossEntropy.apply(logits, labels, rows)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        log_sum_exp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            x, y = logits[start:start + rows].float(), labels[start:start + rows]
            lse = torch.logsumexp(x, dim=-1)
            target = x.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(y != IGNORE_INDEX, lse - target, 0.0).sum()
            log_sum_exp[start:start + rows] = lse
        ctx.save_for_backward(logits, labels, log_sum_exp)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d/dx of (log-sum-exp(x) - x[y]) is softmax(x) - onehot(y), times the incoming gradient.
        logits, labels, log_sum_exp = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            y = labels[start:stop]
            softmax = logits[start:stop].to(torch.float32, copy=True).sub_(log_sum_exp[start:stop, None]).exp_()
            softmax.scatter_add_(1, y.clamp(min=0).unsqueeze(1), softmax.new_full((len(y), 1), -1.0))
            softmax.mul_(torch.where(y != IGNORE_INDEX, grad_total, 0.0).unsqueeze(1))
            grad[start:stop] = softmax
        return grad, None, None
