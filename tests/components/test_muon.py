"""Muon in one process: weft's step equals torch.optim.Muon on the matrices plus torch.optim.AdamW on
the rest (in float64, and as shipped in bf16); its float32 Newton–Schulz is within float32's rounding
of torch's in float64; stacked experts and attention heads equal one torch.optim.Muon per expert or
head; the parameter split; exact resume from the state dict; an AdamW checkpoint refused by a Muon run."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from weft.components.config import Optimizer
from weft.components.training.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, Muon, muon_parameters, newton_schulz
from weft.components.training.optim import adamw_options, build_optimizer
from weft.errors import UserError

from tests.support.tiny_llama import batches, tiny_llama, train

CFG = Optimizer(name="Muon", lr=1e-3, weight_decay=0.05, muon_lr=0.02, muon_weight_decay=0.1, muon_ns_dtype="float32")
# Two float64 computations of one formula differ by the order of their sums only: each rounding is
# 2^-53 (1.1e-16) relative, and 1e-10 leaves a million-fold margin for how a few steps compound them,
# where a difference of formula moves the weights by the step itself (1e-3 and more here).
FLOAT64_TOL = 1e-10


def torch_reference(model, cfg: Optimizer) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the embedding, output and norms
    (its implementation, fused or foreach, the one weft's AdamW picks: the same operations in the same
    order, so their roundings are the same too)."""
    params = dict(model.named_parameters())
    muon = [p for n, p in params.items() if p.ndim == 2 and n not in ("tok_embeddings.weight", "output.weight")]
    rest = [p for p in params.values() if all(p is not q for q in muon)]
    return [torch.optim.Muon(muon, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum,
                             nesterov=cfg.muon_nesterov, adjust_lr_fn=cfg.muon_adjust_lr),
            torch.optim.AdamW(rest, **adamw_options(rest, cfg))]


def assert_weights_close(got, want, tol: float) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        error = ((a - b).norm() / b.norm()).item()
        assert error <= tol, f"{name}: relative difference {error:.2e}"


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_step_equals_torch_muon_and_adamw_in_float64(adjust_lr, monkeypatch):
    """Three steps of the tiny Llama in float64, Newton–Schulz too (torch's bf16 cast made float64)."""
    cfg = replace(CFG, muon_adjust_lr=adjust_lr, muon_ns_dtype="float64")
    model = tiny_llama().double()
    start, reference = copy.deepcopy(model), copy.deepcopy(model)
    train(model, [build_optimizer(model, cfg)], batches())
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda t: t.to(torch.float64, copy=True))
    train(reference, torch_reference(reference, cfg), batches())
    assert_weights_close(model, reference, FLOAT64_TOL)
    for a, b in zip(model.parameters(), start.parameters()):  # every weight moved far beyond the tolerance
        assert ((a - b).norm() / b.norm()).item() > 1e5 * FLOAT64_TOL


@pytest.mark.parametrize("shape", [(64, 64), (176, 64), (64, 176)])
def test_float32_newton_schulz_is_within_its_rounding_of_torch_s_in_float64(shape, monkeypatch):
    """muon_ns_dtype = "float32": each of the iterations' products sums at most n = max(shape) terms,
    each rounding by float32's 2^-24 at most, scaled by the coefficients' |a| + |b| + |c|; their worst
    case over NS_STEPS bounds the difference (the sums' roundings partly cancel: ~25 x 2^-24 found)."""
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda t: t.to(torch.float64, copy=True))
    g = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    theirs = torch.optim._muon._zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, NS_EPS)
    ours = newton_schulz(g.float(), dtype=torch.float32).double()
    bound = NS_STEPS * max(shape) * 2**-24 * sum(map(abs, NS_COEFFICIENTS))
    assert ((ours - theirs).norm() / theirs.norm()).item() <= bound
    assert ((newton_schulz(g.float(), dtype=torch.bfloat16).double() - theirs).norm() / theirs.norm()).item() > bound


def test_bf16_step_equals_torch_muon_as_shipped():
    """Newton–Schulz in bf16 on both sides: the two runs do the same operations in the same order
    (torch_reference's AdamW is weft's implementation), so they round alike on any host; one bf16
    rounding apart in any step would put them 2^-8 of a step (~1e-5 of a weight) apart."""
    cfg = replace(CFG, muon_ns_dtype="bfloat16", muon_nesterov=False)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    train(model, [build_optimizer(model, cfg)], batches())
    train(reference, torch_reference(reference, cfg), batches())
    assert_weights_close(model, reference, 1e-6)


def test_stacked_experts_are_orthogonalised_one_by_one():
    torch.manual_seed(0)
    experts = torch.nn.Parameter(torch.randn(3, 16, 8, dtype=torch.float64))
    separate = [torch.nn.Parameter(e.clone()) for e in experts.detach()]
    ours = Muon([experts], [], lr=0.02, ns_dtype=torch.float64)
    theirs = torch.optim.Muon(separate, lr=0.02)
    for _ in range(2):
        grad = torch.randn(3, 16, 8, dtype=torch.float64)
        experts.grad = grad
        for p, g in zip(separate, grad):
            p.grad = g.clone()
        ours.step()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "bfloat16", lambda t: t.to(torch.float64, copy=True))
            theirs.step()
    for e, p in zip(experts, separate):
        torch.testing.assert_close(e, p, rtol=FLOAT64_TOL, atol=FLOAT64_TOL)


def test_split_keeps_ends_norms_and_excluded_names_for_adamw():
    model = tiny_llama()
    muon, adamw = muon_parameters(model)
    assert "layers.0.attention.wq.weight" in muon and "layers.1.feed_forward.w2.weight" in muon
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= set(adamw)
    assert all(model.get_parameter(n).ndim == 2 for n in muon)
    muon, adamw = muon_parameters(model, ["*.feed_forward.*"])
    assert "layers.0.feed_forward.w1.weight" in adamw and "layers.0.attention.wo.weight" in muon


def test_everything_excluded_is_refused_naming_the_key():
    with pytest.raises(UserError, match="optimizer.muon_exclude"):
        build_optimizer(tiny_llama(), replace(CFG, muon_exclude=["*"]))


def test_resume_from_state_dict_is_exact():
    """Momentum and AdamW moments saved after step 2 and loaded into a fresh optimizer: step 3 as without a stop."""
    tokens = batches()
    straight = tiny_llama()
    train(straight, [build_optimizer(straight, CFG)], tokens)
    stopped = tiny_llama()
    optimizer = build_optimizer(stopped, CFG)
    train(stopped, [optimizer], tokens[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    assert all("momentum_buffer" in saved["state"][i] for i in range(len(optimizer.param_groups[0]["params"])))
    resumed = build_optimizer(stopped, CFG)
    resumed.load_state_dict(saved)
    train(stopped, [resumed], tokens[2:])
    for a, b in zip(stopped.parameters(), straight.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_per_head_blocks_equal_one_torch_muon_per_head(adjust_lr):
    """wq-like rows and wo-like columns split into heads of 4: each head as its own torch.optim.Muon matrix."""
    torch.manual_seed(0)
    f64 = {"dtype": torch.float64}
    wq, wo = torch.nn.Parameter(torch.randn(12, 16, **f64)), torch.nn.Parameter(torch.randn(16, 12, **f64))
    heads = [torch.nn.Parameter(h.clone()) for h in wq.detach().split(4, 0)]
    heads += [torch.nn.Parameter(h.clone()) for h in wo.detach().split(4, 1)]
    ours = Muon([wq, wo], [], lr=0.02, ns_dtype=torch.float64, adjust_lr_fn=adjust_lr,
                blocks={id(wq): (0, 4), id(wo): (1, 4)})
    theirs = torch.optim.Muon(heads, lr=0.02, adjust_lr_fn=adjust_lr)
    for _ in range(2):
        wq.grad, wo.grad = torch.randn(12, 16, **f64), torch.randn(16, 12, **f64)
        for p, g in zip(heads, [*wq.grad.split(4, 0), *wo.grad.split(4, 1)]):
            p.grad = g.clone()
        ours.step()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "bfloat16", lambda t: t.to(torch.float64, copy=True))
            theirs.step()
    torch.testing.assert_close(wq, torch.cat(heads[:3], 0), rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
    torch.testing.assert_close(wo, torch.cat(heads[3:], 1), rtol=FLOAT64_TOL, atol=FLOAT64_TOL)


def test_per_head_option_splits_every_attention_projection():
    optimizer = build_optimizer(tiny_llama(), replace(CFG, muon_per_head=True))
    assert sorted(optimizer.blocks.values()) == [(0, 16)] * 6 + [(1, 16)] * 2  # wq, wk, wv by rows, wo by columns
    with pytest.raises(UserError, match="optimizer.muon_per_head"):
        build_optimizer(tiny_llama(), replace(CFG, muon_per_head=True, muon_exclude=["*.attention.*"]))


@pytest.mark.slow
def test_an_adamw_checkpoint_is_refused_by_a_muon_run_in_one_line(tmp_path, capsys):
    from weft import train as recipe

    from tests.support.train_runs import run_args

    assert recipe.main(run_args(tmp_path, steps=1, checkpoint_every=1)) == 0
    before = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    capsys.readouterr()
    assert recipe.main(run_args(tmp_path, "--optimizer.name", "Muon", steps=2, checkpoint_every=1)) == 2
    err = capsys.readouterr().err
    assert "its optimizer state is AdamW's and this run's optimizer.name is Muon" in err and "\n" not in err.strip()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == before


def test_the_schedule_scales_both_learning_rates_and_the_logged_one_is_muons():
    from weft.components.config import LRScheduler
    from weft.components.training.optim import build_lr_scheduler

    optimizer = build_optimizer(tiny_llama(), CFG)
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=4), total_steps=8)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(CFG.muon_lr * 0.5)  # step 1 of a 4-step warmup
    assert [g["lr"] for g in optimizer.adamw.param_groups] == pytest.approx([CFG.lr * 0.5])


def test_lora_adapters_are_the_matrices_muon_takes():
    from weft.parallelisms.lora import LoRAOptions, apply_lora

    model = apply_lora(tiny_llama(), LoRAOptions(rank=4))
    muon, adamw = muon_parameters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert muon and sorted(muon + adamw) == sorted(trainable) and all(".lora_" in n for n in trainable)
    assert not adamw  # every adapter is 2-D; the frozen base goes to neither
    optimizer = build_optimizer(model, CFG)
    train(model, [optimizer], batches()[:2])
    assert all("momentum_buffer" in optimizer.state[p] for p in optimizer.param_groups[0]["params"])
