"""components/rl/grpo.py against a plain PyTorch computation of TRL 1.16's GRPOTrainer formulas (read
from its wheel): the advantages of each reward scaling (Bessel's correction at 4 generations, rows no
function applies to), every loss type at both importance-sampling levels with and without the KL term,
as TRL computes them micro-step by micro-step on each rank and DDP averages; dapo's loss and gradient
unchanged by world size x accumulation; the clip counts; the per-token log-probabilities."""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

from weft.components.rl.grpo import (
    GRPOOptions,
    StepCounts,
    clip_sums,
    completion_logps,
    micro_batch_loss,
    score_round,
    token_losses,
)
from weft.components.training.loss import IGNORE_INDEX

G = 4  # generations per prompt
N, T = 16, 7  # completions, completion positions
MAX_LEN = 9


def batch(seed: int = 0):
    """A hand-made round: log-probabilities of the policy (a leaf to differentiate), of the sampling
    policy and of a reference, advantages of both signs and completions of different lengths."""
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(N, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3  # ratios well past the clip
    ref = logps.detach() + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[3] = 0  # a completion masked whole (mask_truncated_completions)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return logps, old, ref, advantages, mask


def trl_micro_loss(o: GRPOOptions, logps, old, ref, adv, mask, *, accumulation: int, world: int,
                   items_in_batch: float) -> torch.Tensor:
    """TRL 1.16's _compute_loss for one micro-batch on one rank (steps_per_generation = accumulation)."""
    log_ratio = logps - old
    if o.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    adv = adv.unsqueeze(1)
    if o.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=o.upper).detach() * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon, 1 + o.upper)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if o.beta != 0.0:
        per_token = per_token + o.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if o.loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if o.loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if o.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * o.max_completion_length) / accumulation
    normalizer = items_in_batch / world * accumulation / accumulation  # num_items_in_batch / processes x GA / spg
    return (per_token * mask).sum() / normalizer


def split(world: int, accumulation: int):
    """Rank w's micro-step m: its rows of the step's N completions (contiguous, as weft deals them)."""
    rows = N // (world * accumulation)
    return {(w, m): slice((w * accumulation + m) * rows, (w * accumulation + m + 1) * rows)
            for w in range(world) for m in range(accumulation)}


def step_losses(o: GRPOOptions, world: int, accumulation: int, seed: int = 0):
    """The step's loss and gradient by TRL (DDP's mean over ranks) and by weft (its micro-batch shares,
    each x grad_ranks, averaged over ranks as FSDP does)."""
    results = []
    for method in ("trl", "weft"):
        logps, old, ref, adv, mask = batch(seed)
        counts = StepCounts(sequences=N, tokens=mask.sum().item(), micro_batches=accumulation * world)
        total = torch.zeros((), dtype=torch.float64)
        for part in split(world, accumulation).values():
            args = (logps[part], old[part], ref[part], adv[part], mask[part])
            if method == "trl":
                total = total + trl_micro_loss(o, *args, accumulation=accumulation, world=world,
                                               items_in_batch=mask.sum()) / world
            else:
                losses = token_losses(o, args[0], args[1], args[3], args[4], args[2])
                total = total + micro_batch_loss(o, losses.loss, args[4], counts) * world / world
        total.backward()
        results.append((total.detach(), logps.grad))
    return results


OPTIONS = [GRPOOptions(loss_type, level, 0.2, high, beta, MAX_LEN)
           for loss_type, level, high, beta in itertools.product(
               ("dapo", "grpo", "bnpo", "dr_grpo", "cispo"), ("token", "sequence"), (None, 0.28), (0.0, 0.04))
           if not (loss_type == "cispo" and high is None)]  # cispo's cap is epsilon_high (TRL: e.g. 5)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: f"{o.loss_type}-{o.importance_sampling_level}-"
                         f"high{o.epsilon_high}-beta{o.beta}")
@pytest.mark.parametrize("world, accumulation", [(1, 1), (2, 2)])
def test_every_loss_type_equals_trl_s_per_micro_step_computation(options, world, accumulation):
    if options.loss_type == "cispo":
        options = GRPOOptions("cispo", options.importance_sampling_level, 0.2, 1.5, options.beta, MAX_LEN)
    (trl, trl_grad), (weft, weft_grad) = step_losses(options, world, accumulation)
    torch.testing.assert_close(weft, trl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weft_grad, trl_grad, rtol=1e-12, atol=1e-14)
    assert trl_grad.abs().sum() > 0.1  # the clip does not swallow every gradient


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_dapo_s_loss_and_gradient_do_not_change_with_world_size_times_accumulation(loss_type):
    options = GRPOOptions(loss_type, "token", 0.2, 1.5 if loss_type == "cispo" else None, 0.0, MAX_LEN)
    layouts = [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2)]
    (reference, reference_grad), _ = step_losses(options, *layouts[0])
    for world, accumulation in layouts[1:]:
        (_, _), (loss, grad) = step_losses(options, world, accumulation)
        torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, reference_grad, rtol=1e-12, atol=1e-14)


def test_bnpo_depends_on_the_split_as_trl_s_does():
    """bnpo averages micro-batch means: a different split is a different loss (in TRL too)."""
    options = GRPOOptions("bnpo", "token", 0.2, None, 0.0, MAX_LEN)
    (one, _), _ = step_losses(options, 1, 1)
    (trl, _), (weft, _) = step_losses(options, 2, 2)
    torch.testing.assert_close(weft, trl, rtol=1e-12, atol=1e-14)
    assert abs(weft.item() - one.item()) > 1e-6


def reference_advantages(per_function, weights, scale):
    """Plain Python: weighted sums over the functions that applied, minus the group mean, over the
    group's (or all rewards') sample standard deviation (statistics.stdev: Bessel) + 1e-4."""
    rewards = []
    for row in per_function:
        applied = [w * r for w, r in zip(weights, row) if r is not None]
        rewards.append(sum(applied) if applied else None)
    scored = [r for r in rewards if r is not None]
    advantages = []
    for i, reward in enumerate(rewards):
        group = [r for r in rewards[i - i % G:i - i % G + G] if r is not None]
        if reward is None:
            advantages.append(0.0)
            continue
        mean = statistics.fmean(group)
        std = statistics.stdev(group if scale != "batch" else scored)
        advantages.append((reward - mean) / (std + 1e-4) if scale != "none" else reward - mean)
    return rewards, advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_of_each_scaling_equal_a_plain_computation_with_bessel_s_correction(scale):
    g = torch.Generator().manual_seed(3)
    values = torch.rand(12, 2, generator=g).tolist()
    per_function = [[round(a, 3), round(b, 3)] for a, b in values]
    per_function[1][1] = None  # the second function does not apply to completion 1
    per_function[6] = [None, None]  # no function applies: advantage 0, out of its group's mean
    per_function[8:12] = [[0.5, 1.0]] * 4  # a group all alike: std 0
    weights = [1.0, 0.5]
    tensor = torch.tensor([[float("nan") if v is None else v for v in row] for row in per_function])
    scores = score_round(tensor, torch.tensor(weights), G, scale)
    rewards, advantages = reference_advantages(per_function, weights, scale)
    assert torch.allclose(scores.advantages.double(), torch.tensor(advantages, dtype=torch.float64), atol=1e-5)
    assert scores.advantages[6] == 0 and torch.isnan(scores.rewards[6])
    assert scores.rewards[1].item() == pytest.approx(rewards[1])
    if scale != "batch":
        assert scores.std_zero.tolist() == [False] * 8 + [True] * 4
    if scale == "group":  # Bessel: a group of 4 divides by the sample std (n - 1), not the population's
        group = torch.tensor(rewards[:4])
        population = (group[0] - group.mean()) / (group.std(correction=0) + 1e-4)
        assert abs(scores.advantages[0].item() - population.item()) > 1e-3


def test_clip_counts_follow_trl_s_definitions():
    options = GRPOOptions("dapo", "token", 0.2, 0.28, 0.0, MAX_LEN)
    logps, old, _, adv, mask = batch()
    ratio = torch.exp(logps.detach() - old)
    sums = clip_sums(options, ratio, adv, mask)
    low = (ratio < 0.8) & (adv[:, None] < 0)
    high = (ratio > 1.28) & (adv[:, None] > 0)
    assert sums["low"].item() == pytest.approx((low * mask).sum().item())
    assert sums["high"].item() == pytest.approx((high * mask).sum().item())
    assert sums["region"].item() == pytest.approx(((low | high) * mask).sum().item())
    assert sums["count"].item() == mask.sum().item()
    active = mask.sum(-1) > 0
    per_sequence_high = ((high * mask).sum(-1) / mask.sum(-1).clamp(min=1))[active]
    assert sums["high_max"].item() == pytest.approx(per_sequence_high.max().item())
    assert sums["low"].item() > 0 and sums["high"].item() > 0


def test_completion_logps_are_the_log_softmax_of_the_tempered_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, :2] = IGNORE_INDEX
    logps, entropy = completion_logps(logits, targets, 0.7, entropy=True)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    expected[0, :2] = 0
    torch.testing.assert_close(logps, expected)
    probs = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1))
