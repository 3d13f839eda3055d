"""The on-policy distillation divergence, as TRL 1.16's DistillationTrainer defines it (docs/distillation.md):
per token, the generalized Jensen-Shannon divergence of the student's and the teacher's softmax(logits / T):
KL(p_teacher || p_student) at beta 0, KL(p_student || p_teacher) at beta 1, between them
beta KL(p_teacher || m) + (1 - beta) KL(p_student || m) with m = (1 - beta) p_student + beta p_teacher.
`head_divergence` projects both models' final hidden states through their heads a chunk of positions at a
time, each chunk recomputed in backward (torch.utils.checkpoint): neither model's logits exist for more
than one chunk, and only the hidden states are kept for backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

Project = Callable[[torch.Tensor], torch.Tensor]  # rows of final hidden states [n, D] -> their logits [n, V]


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """[N] per-position divergence of logits [N, V] (fp32 inside); the gradient reaches the student only."""
    log_ps = torch.log_softmax(student.float() / temperature, dim=-1)
    log_pt = torch.log_softmax(teacher.detach().float() / temperature, dim=-1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    return (beta * (log_pt.exp() * (log_pt - log_m)).sum(-1)
            + (1 - beta) * (log_ps.exp() * (log_ps - log_m)).sum(-1))


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N] the entropy of softmax(logits / T) per position, without gradient."""
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(log_p.exp() * log_p).sum(-1)


def whole(logits: torch.Tensor) -> torch.Tensor:
    """Vocabulary-sharded logits (loss parallel) gathered: one chunk's, never the batch's."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def head_divergence(student: torch.Tensor, student_head: Project, teacher: torch.Tensor, teacher_head: Project,
                    mask: torch.Tensor, beta: float, temperature: float,
                    chunk_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence and the student's entropy at each position where mask != 0 ([B, T], 0 elsewhere), of
    the final hidden states [B, T, D] (the teacher's [B, T, D'], without gradient) through each model's
    head, `chunk_positions` positions at a time. A head of `lambda rows: rows` takes logits instead."""
    rows, cols = mask.nonzero(as_tuple=True)

    def chunk(s_rows: torch.Tensor, t_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s_logits = whole(student_head(s_rows))
        with torch.no_grad():
            t_logits = whole(teacher_head(t_rows))
        return divergence(s_logits, t_logits, beta, temperature), entropy(s_logits, temperature)

    divergences, entropies = [], []
    for start in range(0, rows.numel(), chunk_positions):
        at = rows[start:start + chunk_positions], cols[start:start + chunk_positions]
        d, e = checkpoint(chunk, student[at], teacher[at].detach(), use_reentrant=False)
        divergences.append(d)
        entropies.append(e.detach())
    out = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)  # not a view: FSDP hooks the result
    ent = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32)
    if divergences:
        out = out.index_put((rows, cols), torch.cat(divergences))
        ent = ent.index_put((rows, cols), torch.cat(entropies))
    return out, ent

