import math

import pytest
import torch

from weft.components.config import LRScheduler, Optimizer
from weft.components.training.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_multiplier


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


def adamw_by_hand(param, grads, *, lr, beta1, beta2, eps, weight_decay):
    """AdamW (Loshchilov & Hutter) written out in float64, one update per gradient."""
    p, m, v = param.double().clone(), torch.zeros_like(param, dtype=torch.float64), torch.zeros_like(
        param, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("implementation", ["auto", "foreach", "fused"])
def test_adamw_updates_match_the_formula(implementation):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False)
    start = model.weight.detach().clone()
    settings = dict(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    optimizer = build_optimizer(model, Optimizer(implementation=implementation, **settings))
    assert optimizer.defaults["fused"] == (implementation in ("auto", "fused"))  # CPU has the fused kernel
    grads = [torch.randn(8, 16) for _ in range(3)]
    for g in grads:
        model.weight.grad = g.clone()
        optimizer.step()
    want = adamw_by_hand(start, grads, **settings)
    torch.testing.assert_close(model.weight.detach().double(), want, rtol=1e-5, atol=1e-6)
