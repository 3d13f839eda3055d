"""A Mixture-of-Experts feed-forward (Shazeer et al., 2017; as Llama 4 uses it): a router sends
each token to its top-k SwiGLU experts, whose outputs are summed with the token's scores, beside a
shared expert every token passes through.

The routed experts are held stacked ([experts, out, in] per projection) and computed as one grouped
multiply over the tokens sorted by expert, or a loop where it does not apply; a weight may be
frozen in NF4 (layers/nf4_experts.py) or carry per-expert adapters (`LowRankAdapted`). Each layer counts
its experts' tokens (`tokens_per_expert`), holds an `expert_bias` for the choice only, and may add
the load-balancing loss. Nothing here knows about parallelism. When which path runs: docs/moe.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from weft.layers import EXPERT_WEIGHTS
from weft.layers.nf4_experts import NF4Experts, frozen_experts_matmul
from weft.models.common.feed_forward import FeedForward
from weft.models.common.shape_checks import check_top_k

SCORE_FUNCTIONS = ("sigmoid", "softmax")


def route(logits: torch.Tensor, top_k: int, score_func: str, bias: torch.Tensor | None = None,
          norm_topk_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, experts), each [tokens, top_k]: each token's top_k experts by router logit plus
    `bias` (ties to the lower expert index, as torch.topk picks) and their scores, from the logits
    alone: the sigmoid of each chosen logit (Llama 4), or the softmax over all experts taken at the
    chosen ones (Qwen3-MoE), with `norm_topk_prob` divided by their sum so that a token's scores
    add up to 1. (DeepSeek-V3 adds its bias to the sigmoid scores; added to the logits, a zero
    bias leaves the choice exactly as transformers' Llama 4 and Qwen3-MoE make it.)"""
    logits = logits.float()
    experts = (logits if bias is None else logits + bias).topk(top_k, dim=-1).indices
    probabilities = torch.sigmoid(logits) if score_func == "sigmoid" else logits.softmax(-1)
    scores = probabilities.gather(-1, experts)
    return (scores / scores.sum(-1, keepdim=True) if norm_topk_prob else scores), experts


def load_balance_loss(logits: torch.Tensor, experts: torch.Tensor, score_func: str) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al., 2021): n_experts · Σ_i f_i · P_i, with f_i
    the fraction of the tokens' top-k choices that went to expert i and P_i the mean over tokens
    of the router's probability for i (softmax; sigmoid scores normalised over the experts, as
    DeepSeek-V3's sequence-wise loss). 1 when the load is even, up to n_experts when it is not;
    its gradient reaches the router through P."""
    n_experts = logits.shape[-1]
    logits = logits.float()
    if score_func == "softmax":
        probabilities = logits.softmax(-1)
    else:
        scores = torch.sigmoid(logits)
        probabilities = scores / scores.sum(-1, keepdim=True)
    fraction = torch.bincount(experts.flatten(), minlength=n_experts).float() / experts.numel()
    return n_experts * (fraction * probabilities.mean(0)).sum()


class _WithAuxiliaryLoss(torch.autograd.Function):
    """out unchanged; its backward also gives `aux` the gradient 1, as if `aux` had been added to
    the training loss (so the loss need not be carried out of the layer)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_out, torch.ones((), dtype=ctx.aux_dtype, device=grad_out.device)


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts, stacked: expert e computes w2[e](silu(w1[e] x) ⊙ w3[e] x).

    `compute` takes the weights as arguments, so that a parallel transform can run it on its
    rank's part of them (models/common/moe_tp.py: a hidden-dimension slice of every expert)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [tokens, dim] sorted by expert, counts[e] of them for expert e → [tokens, dim]."""
        return self.compute(x, counts, *self.weights())

    def weights(self, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list:
        """w1, w2, w3 as `compute` takes them, each a `LowRankAdapted` where LoRA gave it adapters
        (`lora_A.<w>`, `lora_B.<w>`: parallelisms/lora.py); `local` maps every tensor to the part
        this rank computes with (a parallel transform's local shard)."""
        adapted = getattr(self, "lora_A", None)
        return [LowRankAdapted(local(getattr(self, w)), local(getattr(self.lora_A, w)), local(getattr(self.lora_B, w)),
                               self.lora_scaling) if hasattr(adapted, w) else local(getattr(self, w))
                for w in EXPERT_WEIGHTS]

    def weigh(self, out: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The experts' outputs times their tokens' scores [rows, 1] (`MoE` with score_before_experts
        False); a parallel transform whose outputs are partial sums makes the scores' gradient whole."""
        return out * scores

    @staticmethod
    def compute(x: torch.Tensor, counts: torch.Tensor, w1, w2, w3) -> torch.Tensor:
        """The experts with these weights, in the dtype autocast gives a Linear (autocast does not
        know `_grouped_mm`), else the weights'; grouped where the multiply applies. A weight may
        also be a frozen NF4 stack (QLoRA) or carry low-rank adapters: then each projection is
        its own multiply (`experts_matmul`)."""
        device = x.device.type
        x = x.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w1.dtype)
        if not all(isinstance(w, torch.Tensor) for w in (w1, w2, w3)):
            mm = lambda a, w: experts_matmul(a, counts, w)  # noqa: E731
            return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)
        if grouped_mm_applies(x, w1):
            return grouped(x, counts, w1, w2, w3)
        return (masked if torch.compiler.is_compiling() else loop)(x, counts, w1, w2, w3)


class ClampedSwiGLUExperts(GroupedExperts):
    """gpt-oss's experts: GroupedExperts with a bias after each projection (b1, b3 [experts, hidden],
    b2 [experts, dim]) and the clamped SwiGLU between them: with g = min(w1 x + b1, limit) and
    u = clamp(w3 x + b3, ±limit), expert e computes w2 (g·σ(α g) ⊙ (u + 1)) + b2.

    `weights` hands the biases after w1, w2, w3, so that expert parallelism spreads and passes them
    like the weights (each a [experts, ...] stack)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, *, alpha: float = 1.702, limit: float = 7.0):
        super().__init__(dim, hidden_dim, n_experts)
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(n_experts, dim))
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden_dim))
        self.alpha, self.limit = alpha, limit

    def weights(self, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list:
        """w1, w2, w3 as GroupedExperts hands them, then b1, b2, b3."""
        return super().weights(local) + [local(getattr(self, b)) for b in ("b1", "b2", "b3")]

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w1, w2, w3, b1, b2, b3) -> torch.Tensor:
        """Each projection one multiply over all experts (`experts_matmul`: grouped, NF4 or adapted),
        each row given its expert's bias."""
        device = x.device.type
        x = x.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w1.dtype)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        gate = experts_matmul(x, counts, w1) + b1.to(x.dtype)[owner]
        up = experts_matmul(x, counts, w3) + b3.to(x.dtype)[owner]
        return experts_matmul(clamped_swiglu(gate, up, self.alpha, self.limit), counts, w2) + b2.to(x.dtype)[owner]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: g·σ(α g) ⊙ (u + 1), with g = min(gate, limit), u = clamp(up, ±limit)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class LowRankAdapted(NamedTuple):
    """A stack of expert weights with a rank-r adapter per expert (LoRA, Hu et al., 2021): expert e
    computes with base[e] + scaling · lora_B[e] @ lora_A[e], never formed (`experts_matmul`)."""

    base: torch.Tensor | NF4Experts  # [experts, out, in], frozen
    lora_A: torch.Tensor  # [experts, rank, in]
    lora_B: torch.Tensor  # [experts, out, rank]
    scaling: float

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype


def experts_matmul(x: torch.Tensor, counts: torch.Tensor, w) -> torch.Tensor:
    """Each expert's rows of x times its weight w[e]^T: w a stack [experts, out, in], an NF4 stack
    (dequantized for the multiply, not kept) or a LowRankAdapted, whose adapter adds
    scaling · (x A_e^T) B_e^T to the base's output; grouped where the multiply applies."""
    if isinstance(w, LowRankAdapted):
        low_rank = experts_matmul(experts_matmul(x, counts, w.lora_A), counts, w.lora_B)
        return experts_matmul(x, counts, w.base) + w.scaling * low_rank
    matmul = (grouped_matmul if grouped_mm_applies(x, w) else
              masked_matmul if torch.compiler.is_compiling() else loop_matmul)
    if isinstance(w, NF4Experts):
        return frozen_experts_matmul(x, counts, w, matmul)
    return matmul(x, counts, w.to(x.dtype))


def grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            w3: torch.Tensor) -> torch.Tensor:
    """One grouped matrix multiply per projection over all experts."""
    w1, w2, w3 = (w.to(x.dtype).transpose(1, 2) for w in (w1, w2, w3))
    ends = counts.cumsum(0).to(torch.int32)
    h = F.silu(torch._grouped_mm(x, w1, offs=ends)) * torch._grouped_mm(x, w3, offs=ends)
    return torch._grouped_mm(h, w2, offs=ends)


def grouped_matmul(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of x times its w[e]^T (w [experts, out, in]), one grouped multiply."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))


def loop_matmul(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same, one expert after another."""
    return torch.cat([F.linear(p, w[e]) for e, p in enumerate(x.split(counts.tolist()))])


def masked_matmul(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same, every expert on every row, each row keeping its own expert's (compiled, as `masked`)."""
    owner = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        out = torch.where((owner == e)[:, None], F.linear(x, w[e]), out)
    return out


def loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
         w3: torch.Tensor) -> torch.Tensor:
    """The same, one expert after another (where the grouped multiply does not apply)."""
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    pieces = x.split(counts.tolist())
    return torch.cat([F.linear(F.silu(F.linear(p, w1[e])) * F.linear(p, w3[e]), w2[e])
                      for e, p in enumerate(pieces)])


def masked(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
           w3: torch.Tensor) -> torch.Tensor:
    """The same again, every expert on every row, each row keeping its own expert's output: n_experts
    times the work, but no shape that depends on the routing (compiled, where the grouped
    multiply does not apply and the loop's split would need the counts on the host)."""
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    owner = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        y = F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])
        out = torch.where((owner == e)[:, None], y, out)
    return out


def grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """torch has it; rows are multiples of 16 bytes; bfloat16 only on CUDA and when compiled
    (torch's shape rule for it refuses float32 even where the CPU kernel takes it)."""
    rows = (w1.shape[1] * x.element_size(), w1.shape[2] * x.element_size())
    dtype_ok = x.dtype == torch.bfloat16 or (x.device.type != "cuda" and not torch.compiler.is_compiling())
    return hasattr(torch, "_grouped_mm") and dtype_ok and all(r % 16 == 0 for r in rows)


class MoE(nn.Module):
    """out = shared_expert(x) + Σ over the token's top_k experts e of expert_e(score_e · x) (Llama 4,
    `score_before_experts`), or of score_e · expert_e(x) (the usual placement: Qwen3-MoE, which
    has no shared expert). `norm_topk_prob`: the top_k scores renormalised to sum to 1 (`route`).
    `router_bias`: the router's logits have a learned bias (gpt-oss); `experts`: another stack than
    SwiGLU's (`ClampedSwiGLUExperts`)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, *,
                 shared_hidden_dim: int | None = None, score_func: str = "sigmoid",
                 score_before_experts: bool = True, norm_topk_prob: bool = False, router_bias: bool = False,
                 experts: GroupedExperts | None = None):
        super().__init__()
        check_top_k(top_k, n_experts)
        if score_func not in SCORE_FUNCTIONS:
            raise ValueError(f"score_func {score_func!r}: expected one of {', '.join(SCORE_FUNCTIONS)}")
        self.top_k, self.score_func, self.score_before_experts = top_k, score_func, score_before_experts
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(dim, n_experts, bias=router_bias)  # named as weft.layers.ROUTER: LoRA and float8 skip it
        self.experts = GroupedExperts(dim, hidden_dim, n_experts) if experts is None else experts
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.register_buffer("expert_bias", torch.zeros(n_experts))  # checkpointed: balancing state
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        self.load_balance_coeff = 0.0  # > 0: training adds coeff · load_balance_loss (set by the recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        scores, experts = route(logits, self.top_k, self.score_func, self.expert_bias, self.norm_topk_prob)
        order = experts.flatten().argsort(stable=True)  # (token, slot) pairs sorted by expert
        source = order // self.top_k
        weight = scores.flatten()[order, None].to(x.dtype)
        counts = torch.bincount(experts.flatten(), minlength=self.router.out_features)
        if self.training:  # the step's tokens: not validation's (eval mode); recomputed forwards
            with torch.no_grad():  # (activation checkpointing) count all experts again alike
                self.tokens_per_expert += counts
        routed_in = tokens[source]
        if self.score_before_experts:
            routed = self.experts(routed_in * weight, counts)
        else:
            routed = self.experts.weigh(self.experts(routed_in, counts), weight)
        out = torch.zeros_like(tokens, dtype=routed.dtype).index_add(0, source, routed)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.training and self.load_balance_coeff > 0:
            aux = self.load_balance_coeff * load_balance_loss(logits, experts, self.score_func)
            out = _WithAuxiliaryLoss.apply(out, aux)
        return out.view_as(x)
