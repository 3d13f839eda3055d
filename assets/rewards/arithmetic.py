"""Reward functions for the shipped arithmetic prompts (assets/make_arithmetic.py), as a user brings
their own: rl.reward_functions = ["assets/rewards/arithmetic.py:digits", ...]. TRL's signature:
f(prompts, completions, completion_ids, **columns) -> one float (or None) per completion."""

from __future__ import annotations


def digits(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of the completion's characters (spaces aside) that are digits: the answer's form,
    a dense signal a model from scratch can climb."""
    rewards = []
    for completion in completions:
        text = "".join(completion.split())
        rewards.append(sum(c.isdigit() for c in text) / len(text) if text else 0.0)
    return rewards


def exact(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1 if the completion starts with the row's answer (then ends or leaves the number), else 0."""
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer):
        text = completion.strip()
        rewards.append(None if expected is None else float(
            text.startswith(expected) and not text[len(expected):len(expected) + 1].isdigit()))
    return rewards
