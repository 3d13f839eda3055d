"""Preference objectives on pairs of answers: DPO (`sigmoid`), IPO, SimPO and ORPO, and TRL's reward metrics.

A micro-batch holds pairs as rows chosen, rejected, chosen, ...; `answer_logps` gives each row's
summed log-probability of its supervised (answer) tokens and their number. Each loss is a function
of the policy's (and, for DPO and IPO, the reference's) log-probabilities, one value per pair, as
written in its paper: docs/preference.md has the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from weft.components.training.loss import IGNORE_INDEX, chunked_cross_entropy

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
# The per-pair values every step reports (summed over the pairs, then divided by their number), as TRL names them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class PreferenceOptions:
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid, simpo: the chance that a pair's preference is flipped
    gamma: float = 0.5  # simpo: the target margin

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    @property
    def averaged(self) -> bool:
        """Whether the loss reads the mean log-probability per answer token (all but DPO: the sum)."""
        return self.loss != "sigmoid"


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of log p(label) over its supervised tokens (fp32, never holding fp32 logits
    whole: `chunked_cross_entropy` row by row), and how many there are.

    logits [rows, seq, vocab] (a vocabulary-sharded DTensor under loss parallel); labels [rows, seq]."""
    if isinstance(logits, DTensor):  # gathered whole: torch's loss parallel has no per-row loss
        logits = logits.full_tensor()
    nll = torch.stack([chunked_cross_entropy(logits[row], labels[row]) for row in range(labels.shape[0])])
    return -nll, (labels != IGNORE_INDEX).sum(-1)


class _SumOverRanks(torch.autograd.Function):
    """Sum over a group's ranks forward; the gradient passes through unchanged (each context-parallel
    rank back-propagates the whole sequence's loss into its own tokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_ranks(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` summed over `group` (None: as is); under context parallelism each rank holds part of a row's tokens."""
    return x if group is None else _SumOverRanks.apply(x, group)


def sigmoid_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                 beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), conservative with label smoothing ε:
    -(1-ε) log σ(β h) - ε log σ(-β h), h = (log π_c - log π_r) - (log π_ref,c - log π_ref,r)."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def ipo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1/(2τ))², h as DPO's over mean per-token log-probabilities, τ = beta."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO (Meng et al. 2024), reference-free: -log σ(β (mean log π_c - mean log π_r) - γ)."""
    z = beta * (chosen - rejected) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def orpo_odds_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024), λ = beta: -λ log σ(log odds(c) - log odds(r)), over
    mean per-token log-probabilities, odds(y) = p / (1 - p). ORPO adds the chosen answers' NLL."""
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return -beta * F.logsigmoid(log_odds)


def pair_losses(options: PreferenceOptions, logps: torch.Tensor, tokens: torch.Tensor,
                reference: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's loss (ORPO: its odds-ratio term) and metrics, from rows' summed log-probabilities
    `logps` and answer tokens `tokens` (interleaved chosen, rejected) and the reference's (None: reference-free)."""
    if options.averaged:
        logps = logps / tokens.clamp(min=1)
        reference = None if reference is None else reference / tokens.clamp(min=1)
    chosen, rejected = logps[0::2], logps[1::2]
    beta = options.beta
    if options.loss == "sigmoid":
        ref_c, ref_r = reference[0::2], reference[1::2]
        losses = sigmoid_loss(chosen, rejected, ref_c, ref_r, beta, options.label_smoothing)
    elif options.loss == "ipo":
        ref_c, ref_r = reference[0::2], reference[1::2]
        losses = ipo_loss(chosen, rejected, ref_c, ref_r, beta)
    elif options.loss == "simpo":
        ref_c = ref_r = torch.zeros_like(chosen)
        losses = simpo_loss(chosen, rejected, beta, options.gamma, options.label_smoothing)
    else:
        ref_c = ref_r = torch.zeros_like(chosen)
        losses = orpo_odds_loss(chosen, rejected, beta)
    with torch.no_grad():
        reward_c, reward_r = beta * (chosen - ref_c), beta * (rejected - ref_r)
        metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r, "rewards/margins": reward_c - reward_r,
                   "rewards/accuracies": (reward_c > reward_r).float(), "logps/chosen": chosen.detach(),
                   "logps/rejected": rejected.detach()}
    return losses, metrics
