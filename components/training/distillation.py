"""The on-policy distillation divergence, as TRL 1.16's DistillationTrainer defines it (docs/distillation.md):
per token, the generalized Jensen-Shannon divergence of the student's and the teacher's softmax(logits / T):
KL(p_teacher || p_student) at beta 0, KL(p_student || p_teacher) at beta 1, between them
beta KL(p_teacher || m) + (1 - beta) KL(p_student || m) with m = (1 - beta) p_student + beta p_teacher.
`token_divergence` runs it over chunks of positions, each recomputed in backward (torch.utils.checkpoint),
so one chunk's fp32 distributions exist at a time.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


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


def token_divergence(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float,
                     temperature: float, chunk_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence and the student's entropy at each position where mask != 0 ([B, T], 0 elsewhere), of
    logits [B, T, V] (vocabulary-sharded DTensors under loss parallel are gathered), `chunk_positions` at a time."""
    if isinstance(student, DTensor):
        student = student.full_tensor()
    if isinstance(teacher, DTensor):
        teacher = teacher.full_tensor()
    vocab = student.shape[-1]
    where = mask.reshape(-1).nonzero().squeeze(-1)
    flat_student, flat_teacher = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
    divergences, entropies = [], []
    for start in range(0, where.numel(), chunk_positions):
        index = where[start:start + chunk_positions]
        s, t = flat_student[index], flat_teacher[index]
        divergences.append(checkpoint(divergence, s, t, beta, temperature, use_reentrant=False))
        entropies.append(entropy(s, temperature))
    out = torch.zeros(mask.numel(), device=mask.device, dtype=torch.float32)
    ent = torch.zeros(mask.numel(), device=mask.device, dtype=torch.float32)
    if divergences:
        out = out.index_put((where,), torch.cat(divergences))
        ent = ent.index_put((where,), torch.cat(entropies))
    return out.view(mask.shape), ent.view(mask.shape)
