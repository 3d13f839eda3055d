"""The GRPO family's arithmetic, as TRL 1.16's GRPOTrainer defines it (docs/rl.md has the formulas).

`score_round`: a generation round's rewards and advantages (each completion's reward minus its
group's mean, divided by the group's or the batch's standard deviation, Bessel-corrected, + 1e-4).
`token_losses`: the clipped importance-weighted per-token loss of each loss type, at token or
sequence (GSPO) level, plus β times the k3 estimate of KL to a reference. `micro_batch_loss`: a
micro-batch's share of the optimizer step's loss, aggregated as its loss type says, so that the
sum over the step's micro-batches and ranks is TRL's loss whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from weft.components.training.loss import IGNORE_INDEX

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALINGS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: added to the standard deviation the advantages are divided by


@dataclass(frozen=True)
class GRPOOptions:
    """The [rl] keys the loss reads (TRL's names). epsilon_high None: epsilon."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int = 512  # dr_grpo's constant normaliser

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the non-NaN values with Bessel's correction (NaN where fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


@dataclass(frozen=True)
class Scores:
    """A round's completions, in order (prompt by prompt, its num_generations together)."""

    rewards: torch.Tensor  # [N] the weighted sum over the functions; NaN where none applied
    advantages: torch.Tensor  # [N]; 0 where no function applied
    std_zero: torch.Tensor  # [N] bool: the std the advantage was scaled by is 0 (a group all alike)


def score_round(rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                scale_rewards: str) -> Scores:
    """rewards_per_function [N, F] (NaN: that function returned None for that completion); the
    round's N completions in groups of num_generations consecutive ones."""
    rewards = (rewards_per_function * weights[None, :]).nansum(dim=1)
    rewards[torch.isnan(rewards_per_function).all(dim=1)] = float("nan")  # unscorable: out of the baselines
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # group (and none, whose std only says which groups are all alike)
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return Scores(rewards, torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std)))


@dataclass
class TokenLosses:
    loss: torch.Tensor  # [rows, T], or [rows, 1] at sequence level without a KL term (broadcasts over T)
    ratio: torch.Tensor  # the importance weight exp(log π - log π_old): [rows, T] or [rows, 1]
    kl: torch.Tensor | None  # [rows, T] with β > 0


def token_losses(options: GRPOOptions, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, ref_logps: torch.Tensor | None = None) -> TokenLosses:
    """The per-token loss: -min(r A, clip(r, 1 - ε, 1 + ε_high) A) (cispo: -sg(min(r, ε_high)) A log π),
    r per token or, at sequence level, exp of the sequence's masked mean log-ratio; + β k3-KL."""
    log_ratio = logps - old_logps
    if options.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    advantages = advantages[:, None]
    if options.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=options.upper).detach() * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - options.epsilon, 1 + options.upper)
        loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if options.beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + options.beta * kl
    return TokenLosses(loss, ratio, kl)


@dataclass(frozen=True)
class StepCounts:
    """What the optimizer step's loss is divided by, counted over all its micro-batches and ranks."""

    sequences: int  # completions
    tokens: float  # completion tokens the loss covers
    micro_batches: int  # gradient_accumulation_steps x data-parallel ranks


def micro_batch_loss(options: GRPOOptions, loss: torch.Tensor, mask: torch.Tensor, counts: StepCounts) -> torch.Tensor:
    """This micro-batch's share of the step's loss. grpo: the mean over the step's sequences of each
    one's token mean; bnpo: the micro-batch's token mean, averaged over micro-batches; dr_grpo: its sum
    over rows x max_completion_length, averaged likewise; dapo, cispo: the sum over the step's tokens."""
    masked = loss * mask
    if options.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts.sequences
    if options.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / counts.micro_batches
    if options.loss_type == "dr_grpo":
        return masked.sum() / (loss.shape[0] * options.max_completion_length) / counts.micro_batches
    return masked.sum() / max(counts.tokens, 1.0)


def clip_sums(options: GRPOOptions, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
              ) -> dict[str, torch.Tensor]:
    """The clipping counts of TRL's clip_ratio metrics, as sums to reduce over micro-batches and ranks:
    tokens (sequences at sequence level) clipped low, high, either, out of `count`; and per sequence
    the fraction clipped low and high (`low_min`, `high_max` take their min and max)."""
    advantages = advantages[:, None]
    if options.loss_type == "cispo":
        low = torch.zeros_like(ratio, dtype=torch.bool)
        high = (ratio > options.upper) & (advantages > 0)
    else:
        low = (ratio < 1 - options.epsilon) & (advantages < 0)
        high = (ratio > 1 + options.upper) & (advantages > 0)
    weight = mask if ratio.shape[1] > 1 else torch.ones_like(ratio)
    active = mask.sum(-1) > 0
    per_sequence = [((x.float() * weight).sum(-1) / weight.sum(-1).clamp(min=1.0))[active] for x in (low, high)]
    inf = torch.tensor(float("inf"), device=ratio.device)
    return {"low": (low.float() * weight).sum(), "high": (high.float() * weight).sum(),
            "region": ((low | high).float() * weight).sum(), "count": weight.sum(),
            "low_min": per_sequence[0].min() if per_sequence[0].numel() else inf,
            "high_max": per_sequence[1].max() if per_sequence[1].numel() else -inf}


def completion_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position: log softmax(logits / temperature)[target] (0 where the target is IGNORE_INDEX) and,
    with `entropy`, the entropy of that distribution (no gradient). Row by row: the fp32 log-softmax
    of one row at a time. logits [rows, T, V]; targets [rows, T]. temperature 0 (greedy): of the logits."""
    if isinstance(logits, DTensor):  # vocabulary-sharded under loss parallel: gathered whole, one step's rows
        logits = logits.full_tensor()
    scale = temperature if temperature > 0 else 1.0
    logps, entropies = [], []
    for row in range(targets.shape[0]):
        log_probs = torch.log_softmax(logits[row].float() / scale, dim=-1)
        logps.append(log_probs.gather(-1, targets[row].clamp(min=0)[:, None])[:, 0])
        if entropy:
            with torch.no_grad():
                entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    logps = torch.stack(logps) * (targets != IGNORE_INDEX)
    return logps, torch.stack(entropies) if entropy else None
