"""The sampling options (`SamplingParams`) and what one decode step does with a batch's last logits:
temperature, the top-k, top-p and min-p filters, a draw from each completion's own CPU generator, and
the log-probability of the drawn token."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off.
    Each field is checked on construction (ValueError naming the field, its value and the rule)."""

    max_completion_length: int = 256  # new tokens at most per completion
    temperature: float = 1.0
    top_p: float = 1.0  # keep the most likely tokens whose probabilities first sum to top_p
    top_k: int = 0  # keep the k most likely tokens
    min_p: float = 0.0  # keep the tokens at least min_p times as likely as the most likely one
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings: a completion ends with the token that completes one

    def __post_init__(self) -> None:
        rules = (("max_completion_length", _is_int(self.max_completion_length) and self.max_completion_length >= 1,
                  "an integer >= 1"),
                 ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
                 ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
                 ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0: off)"),
                 ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
                 ("seed", _is_int(self.seed) and 0 <= self.seed < 2**63, "an integer in [0, 2**63)"),
                 ("stop", isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
                  "a tuple of non-empty strings"))
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"sampling {name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """Whether each token is the most likely one (temperature 0)."""
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def completion_generator(seed: int, prompt_index: int, j: int) -> torch.Generator:
    """The CPU generator completion `j` of prompt `prompt_index` draws from: seeded from the three
    numbers alone, so a completion is the same in any batch, batch size or layout."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{j}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [rows, vocab] / temperature with the tokens top_k, top_p and min_p leave out set to
    -inf, in that order (each filter on the probabilities the one before left)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams,
                generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each row draws from its last logits [rows, vocab] (greedy: the most likely; else from
    `filter_logits`'s softmax with the row's generator) and its log-probability, log softmax(logits /
    temperature) over the whole vocabulary (temperature 0: of the logits): CPU tensors [rows]."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1)
    else:
        probs = filter_logits(logits, params).softmax(-1).cpu()
        tokens = torch.cat([torch.multinomial(row, 1, generator=generator) for row, generator in zip(probs, generators)])
        logprobs = (logits / params.temperature).log_softmax(-1)
    tokens = tokens.to(logits.device)
    return tokens.cpu(), logprobs.gather(-1, tokens[:, None])[:, 0].cpu()
