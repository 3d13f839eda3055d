"""Preference objectives on pairs of answers: DPO (`sigmoid`), IPO, SimPO and ORPO, and TRL's reward metrics.

A micro-batch holds pairs as rows chosen, rejected, chosen, ...; `answer_logps` gives each row's
summed log-probability of its supervised (answer) tokens and their number. Each loss is a function
of the policy's (and, for DPO and IPO, the reference's) log-probabilities, one value per pair, as
TRL 1.16 computes it (docs/preference.md has the formulas); `micro_batch_loss` is a micro-batch's
share of the step's loss, ORPO's NLL term included.
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
    `logps` and answer tokens `tokens` (interleaved chosen, rejected) and the reference's (None: reference-free).
    The metrics mean what TRL 1.16 logs under their names: DPO and IPO as its DPOTrainer (β × the summed
    log-ratios, the summed log-probabilities, whatever the loss averages), SimPO as its CPOTrainer and
    ORPO as its ORPOTrainer (β × the mean log-probabilities, and those)."""
    sums = logps
    if options.averaged:
        logps = logps / tokens.clamp(min=1)
    chosen, rejected = logps[0::2], logps[1::2]
    beta = options.beta
    if options.loss in ("sigmoid", "ipo"):
        ratios = sums - reference  # summed log-ratios: DPO's h, and the rewards of both
        if options.loss == "sigmoid":
            losses = sigmoid_loss(sums[0::2], sums[1::2], reference[0::2], reference[1::2], beta,
                                  options.label_smoothing)
        else:
            ref = reference / tokens.clamp(min=1)
            losses = ipo_loss(chosen, rejected, ref[0::2], ref[1::2], beta)
        reported = sums
    else:
        ratios = logps
        losses = (simpo_loss(chosen, rejected, beta, options.gamma, options.label_smoothing) if options.loss == "simpo"
                  else orpo_odds_loss(chosen, rejected, beta))
        reported = logps
    with torch.no_grad():
        reward_c, reward_r = beta * ratios[0::2], beta * ratios[1::2]
        metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r, "rewards/margins": reward_c - reward_r,
                   "rewards/accuracies": (reward_c > reward_r).float(), "logps/chosen": reported[0::2].detach(),
                   "logps/rejected": reported[1::2].detach()}
    return losses, metrics


def chosen_nll(logits: torch.Tensor, row_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's NLL term as TRL 1.16's ORPOTrainer defines it: per chosen row (rows 0, 2, ...), the summed
    NLL of every token after the first, prompt and answer (`Batch.row_labels`), and how many there are.
    The step's term is their sum over the global batch divided by the global batch's count of them."""
    logps, tokens = answer_logps(logits[0::2], row_labels[0::2])
    return -logps, tokens


def nll_tokens(row_labels: torch.Tensor) -> torch.Tensor:
    """How many tokens ORPO's NLL term averages over in a micro-batch: its chosen rows' (see chosen_nll)."""
    return (row_labels[0::2] != IGNORE_INDEX).sum()


def micro_batch_loss(options: PreferenceOptions, logits: torch.Tensor, labels: torch.Tensor,
                     row_labels: torch.Tensor | None, reference: torch.Tensor | None, pairs: torch.Tensor | float,
                     nll_count: torch.Tensor | float, cp_group: dist.ProcessGroup | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the step's objective and its pairs' metrics: its pairs' losses over
    the global batch's `pairs`; ORPO adds its chosen rows' NLL (`chosen_nll`) over `nll_count`, the
    global batch's `nll_tokens`. Under context parallelism (`cp_group`) each rank holds part of every
    row; the rows' sums are summed over it, and each rank's loss is the whole micro-batch's."""
    logps, tokens = answer_logps(logits, labels)
    logps, tokens = sum_over_ranks(logps, cp_group), sum_over_ranks(tokens, cp_group)
    losses, metrics = pair_losses(options, logps, tokens, reference if options.needs_reference else None)
    loss = losses.sum() / pairs
    if options.loss == "orpo":
        nll, _ = chosen_nll(logits, row_labels)
        loss = loss + sum_over_ranks(nll, cp_group).sum() / nll_count
    return loss, metrics
