"""The built-in reward functions, by the names rl.reward_functions takes; each is made for the run's
rl.answer_tag (`<answer>...</answer>` for "answer").

- `math_answer`: 1 if the completion's final answer (inside the tag if it has one, else the whole
  completion) equals the row's `answer` column mathematically (math-verify: `pip install "weft[rl]"`),
  else 0; None for a row without an answer.
- `format`: 1 if the completion holds its answer inside the tag, else 0.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """A completion as text: itself, or the content of its last message (chat prompts)."""
    return completion if isinstance(completion, str) else str(completion[-1].get("content", ""))


def _tagged(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def math_answer(tag: str) -> Callable[..., list[float | None]]:
    """The math-answer reward for answers inside <tag>...</tag> (math-verify checks them)."""
    verifier = importlib.import_module("math_verify")  # the optional extra weft[rl]; the plan checks it is installed
    parse, verify = verifier.parse, verifier.verify
    pattern = _tagged(tag)

    def math_answer(prompts, completions, completion_ids, answer=None, **columns) -> list[float | None]:
        if answer is None:
            return [None] * len(completions)
        rewards: list[float | None] = []
        for completion, gold in zip(completions, answer):
            if gold is None:
                rewards.append(None)
                continue
            text = completion_text(completion)
            found = pattern.findall(text)
            given = found[-1] if found else text
            gold_text = str(gold)
            expected = parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"${gold_text}$")
            rewards.append(1.0 if given.strip() and verify(expected, parse(given)) else 0.0)
        return rewards

    return math_answer


def format_reward(tag: str) -> Callable[..., list[float]]:
    """The format reward: is there an answer inside <tag>...</tag>."""
    pattern = _tagged(tag)

    def tagged(prompts, completions, completion_ids, **columns) -> list[float]:
        return [1.0 if any(m.strip() for m in pattern.findall(completion_text(c))) else 0.0 for c in completions]

    tagged.__name__ = "format"  # its metrics: rewards/format/mean
    return tagged


BUILTINS: dict[str, Callable[[str], Callable[..., list]]] = {"math_answer": math_answer, "format": format_reward}
