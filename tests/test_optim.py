import math

import pytest
import torch

from components.config import LRScheduler, Optimizer
from components.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_multiplier


def schedule(decay_type: str, min_lr_ratio: float = 0.0) -> list[float]:
    return [lr_multiplier(s, warmup_steps=4, total_steps=14, decay_type=decay_type, min_lr_ratio=min_lr_ratio)
            for s in range(14)]


def test_warmup_is_linear_to_the_peak():
    assert schedule("linear")[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_linear_decay_formula():
    # After warmup, step s uses 1 - (s - warmup) / (total - warmup), floored at min_lr_ratio.
    got = schedule("linear", min_lr_ratio=0.1)[4:]
    want = [0.1 + 0.9 * (1 - k / 10) for k in range(10)]
    assert got == pytest.approx(want)


def test_cosine_decay_formula():
    got = schedule("cosine")[4:]
    want = [0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(10)]
    assert got == pytest.approx(want)


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, Optimizer(lr=1e-2))
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2, decay_type="linear"), total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([5e-3, 1e-2, 1e-2, 7.5e-3, 5e-3, 2.5e-3])


def test_adamw_settings_come_from_config():
    optimizer = build_optimizer(torch.nn.Linear(2, 2), Optimizer(lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-6,
                                                                  weight_decay=0.05))
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.8, 0.9), 1e-6, 0.05)


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    a(torch.randn(3, 8)).pow(2).sum().backward()
    for pb, pa in zip(b.parameters(), a.parameters()):
        pb.grad = pa.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(list(a.parameters()), 0.5)
    got = clip_grad_norm_(list(b.parameters()), 0.5)
    torch.testing.assert_close(got, want)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad)


def test_zero_max_norm_measures_without_clipping():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm_([p], 0.0).item() == pytest.approx(5.0)
    assert p.grad.tolist() == [3.0, 4.0, 0.0]
