"""The preference objectives against their papers' formulas on a hand-checked batch (scalar math, not
torch), and answer log-probabilities against log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

from weft.components.training.loss import IGNORE_INDEX
from weft.components.training.preference import PreferenceOptions, answer_logps, pair_losses

# One pair: summed answer log-probabilities and answer tokens, chosen then rejected.
LOGPS = torch.tensor([-1.0, -3.0])  # policy
TOKENS = torch.tensor([2, 3])
REFERENCE = torch.tensor([-2.0, -2.5])


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_with_label_smoothing():
    losses, metrics = pair_losses(PreferenceOptions("sigmoid", beta=0.1, label_smoothing=0.2), LOGPS, TOKENS, REFERENCE)
    h = (-1 - -3) - (-2 - -2.5)  # 1.5
    want = -0.8 * log_sigmoid(0.1 * h) - 0.2 * log_sigmoid(-0.1 * h)
    assert losses.item() == pytest.approx(want, rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * (-1 - -2))
    assert metrics["rewards/rejected"].item() == pytest.approx(0.1 * (-3 - -2.5))
    assert metrics["rewards/margins"].item() == pytest.approx(0.15)
    assert metrics["rewards/accuracies"].item() == 1.0
    assert metrics["logps/chosen"].item() == -1.0 and metrics["logps/rejected"].item() == -3.0


def test_dpo_is_ln2_when_policy_is_reference():
    losses, metrics = pair_losses(PreferenceOptions(), LOGPS, TOKENS, LOGPS.clone())
    assert losses.item() == pytest.approx(math.log(2), rel=1e-7)
    assert metrics["rewards/margins"].item() == 0 and metrics["rewards/accuracies"].item() == 0


def test_ipo_on_mean_log_probabilities_with_dpo_s_rewards():
    losses, metrics = pair_losses(PreferenceOptions("ipo", beta=0.5), LOGPS, TOKENS, REFERENCE)
    h = (-1 / 2 - -3 / 3) - (-2 / 2 - -2.5 / 3)  # 0.5 - (-1/6) = 2/3
    assert losses.item() == pytest.approx((h - 1 / (2 * 0.5)) ** 2, rel=1e-6)  # (2/3 - 1)^2 = 1/9
    # logged as TRL's DPOTrainer logs every loss: β × the summed log-ratios, the summed log-probabilities
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5 * (-1 - -2))
    assert metrics["rewards/rejected"].item() == pytest.approx(0.5 * (-3 - -2.5))
    assert metrics["logps/chosen"].item() == -1.0 and metrics["logps/rejected"].item() == -3.0


def test_simpo_is_reference_free_with_margin_gamma():
    losses, metrics = pair_losses(PreferenceOptions("simpo", beta=2.0, gamma=0.5), LOGPS, TOKENS, None)
    z = 2.0 * (-1 / 2 - -3 / 3) - 0.5  # 0.5
    assert losses.item() == pytest.approx(-log_sigmoid(z), rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(2.0 * -0.5)
    assert metrics["rewards/rejected"].item() == pytest.approx(2.0 * -1.0)


def test_orpo_odds_ratio_term():
    losses, metrics = pair_losses(PreferenceOptions("orpo", beta=0.1), LOGPS, TOKENS, None)
    c, r = -0.5, -1.0  # mean log-probabilities
    log_odds = (c - math.log(1 - math.exp(c))) - (r - math.log(1 - math.exp(r)))
    assert losses.item() == pytest.approx(-0.1 * log_sigmoid(log_odds), rel=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx(0.1 * (c - r))


def test_answer_logps_sum_supervised_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[3, 1, IGNORE_INDEX, 4, IGNORE_INDEX], [IGNORE_INDEX] * 4 + [6]])
    logps, tokens = answer_logps(logits, labels)
    table = torch.log_softmax(logits, -1)
    assert logps[0].item() == pytest.approx((table[0, 0, 3] + table[0, 1, 1] + table[0, 3, 4]).item(), rel=1e-6)
    assert logps[1].item() == pytest.approx(table[1, 4, 6].item(), rel=1e-6)
    assert tokens.tolist() == [3, 1]
