"""components/training/distillation.py against a plain PyTorch computation of TRL 1.16's generalized JSD
(the definition its chunked_divergence kernel computes): beta 0, 0.5 and 1 at a temperature other than 1,
a Gemma-style teacher's logits scaled and soft-capped first; the chunked form equals the whole one in
value and gradient, and keeps less for backward (the bytes autograd saves, measured); projecting hidden
states through the heads chunk by chunk equals the whole logits' divergence at a seventh of its peak memory."""

from __future__ import annotations

import pytest
import torch

from weft.components.training.distillation import divergence, head_divergence

V, T_LEN, B = 50, 6, 3


def token_divergence(student, teacher, mask, beta, temperature, chunk_positions):
    """`head_divergence` of logits already computed: each model's head hands its rows on as they are."""
    rows = lambda logits: logits  # noqa: E731
    return head_divergence(student, rows, teacher, rows, mask, beta, temperature, chunk_positions)


def plain_gjsd(student, teacher, beta, temperature):
    """Per position, in float64, straight from the definition."""
    ps = torch.softmax(student.double() / temperature, -1)
    pt = torch.softmax(teacher.double() / temperature, -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum(-1)  # noqa: E731
    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def logits(seed: int):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T_LEN, V, generator=g) * 2).requires_grad_()
    hidden = torch.randn(B, T_LEN, 8, generator=g)
    head = torch.randn(8, V, generator=g)
    scale, softcap = 0.5, 3.0  # Gemma-style: the teacher's forward scales and soft-caps its logits
    teacher = softcap * torch.tanh(scale * (hidden @ head) / softcap)
    mask = torch.ones(B, T_LEN)
    mask[0, :2] = 0  # prompt positions
    mask[2, 4:] = 0  # padding after a short completion
    return student, teacher, mask


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_equals_trl_s_definition(beta):
    student, teacher, mask = logits(0)
    got, entropy = token_divergence(student, teacher, mask, beta, 0.7, chunk_positions=4)
    expected = plain_gjsd(student.detach(), teacher, beta, 0.7) * mask
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert (got[mask == 0] == 0).all() and got[mask == 1].min() > 0
    p = torch.softmax(student.detach().double() / 0.7, -1)
    torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1) * mask, rtol=1e-5, atol=1e-6)
    # the gradient: the plain definition's, reaching the student only
    (got * mask).sum().backward()
    reference = student.detach().clone().requires_grad_()
    (plain_gjsd(reference, teacher, beta, 0.7) * mask).sum().backward()
    torch.testing.assert_close(student.grad.double(), reference.grad.double(), rtol=1e-5, atol=1e-6)


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while `fn` runs (its saved tensors)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_chunks_equal_the_whole_and_keep_less_for_backward():
    student, teacher, mask = logits(1)
    whole_student = student.detach().clone().requires_grad_()
    whole = token_divergence(whole_student, teacher, mask, 0.5, 1.3, chunk_positions=B * T_LEN)[0]
    chunked = token_divergence(student, teacher, mask, 0.5, 1.3, chunk_positions=2)[0]
    torch.testing.assert_close(chunked, whole)
    whole.sum().backward()
    chunked.sum().backward()
    torch.testing.assert_close(student.grad, whole_student.grad)
    unchunked_saved = saved_bytes(lambda: token_divergence(whole_student, teacher, mask, 0.5, 1.3, B * T_LEN))
    chunked_saved = saved_bytes(lambda: token_divergence(student, teacher, mask, 0.5, 1.3, 2))
    # checkpointed chunks keep their inputs only (their fp32 distributions are recomputed in backward):
    # against the same divergence run whole without recomputation, which keeps them for every position
    plain_saved = saved_bytes(lambda: divergence(student.reshape(-1, V), teacher.reshape(-1, V), 0.5, 1.3).sum())
    assert chunked_saved <= unchunked_saved and chunked_saved * 3 < plain_saved, (chunked_saved, plain_saved)


PEAK_SCRIPT = """
import json, sys
import torch
from weft.components.training.distillation import head_divergence

torch.manual_seed(0)
n, d, vocab, mode = 1024, 64, 32000, sys.argv[1]
student, teacher = torch.randn(1, n, d, requires_grad=True), torch.randn(1, n, d)
head, teacher_head = (torch.randn(vocab, d) * 0.1).requires_grad_(), torch.randn(vocab, d) * 0.1
mask = torch.ones(1, n)
def status_kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:  # the peak resident set (VmHWM) restarts from the current one
    f.write("5")
before = status_kib("VmRSS")
if mode == "whole":  # both models' logits for every position, then the divergence over them
    rows = lambda logits: logits
    div = head_divergence(student @ head.T, rows, teacher @ teacher_head.T, rows, mask, 0.5, 1.3, chunk_positions=n)[0]
else:
    div = head_divergence(student, lambda rows: rows @ head.T, teacher, lambda rows: rows @ teacher_head.T,
                          mask, 0.5, 1.3, chunk_positions=128)[0]
div.sum().backward()
peak = status_kib("VmHWM") - before
print(json.dumps({"peak_kib": peak, "loss": div.sum().item(), "head_grad": head.grad.double().norm().item(),
                  "hidden_grad": student.grad.double().norm().item()}))
"""


@pytest.mark.slow
def test_projecting_chunks_of_hidden_states_equals_whole_logits_at_a_fraction_of_the_peak_memory():
    """1,024 positions, a 32,000-token vocabulary: the whole-logits divergence holds each model's logits
    (125 MiB apiece) and its fp32 distributions; the chunked one 128 positions' at a time. Each runs in a
    fresh process, its peak resident memory (Linux's VmHWM, reset just before) measured above what it held
    before the divergence (glibc told to map every block of 64 KiB or more on its own, so that a freed one
    leaves the resident set)."""
    import json
    import subprocess
    import sys

    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode], capture_output=True, text=True, check=True,
                             env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
        return json.loads(out.stdout)

    whole, chunked = run("whole"), run("chunked")
    for key in ("loss", "head_grad", "hidden_grad"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5), key
    logits_kib = 1024 * 32000 * 4 // 1024
    assert whole["peak_kib"] > 2 * logits_kib, whole  # both models' logits at once, at least
    assert chunked["peak_kib"] * 4 < whole["peak_kib"], (chunked, whole)
