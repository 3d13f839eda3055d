"""rollouts.jsonl in the dump folder: one line per completion a run trained on, so a user can read
what the policy writes (step, prompt, prompt_ids, completion, completion_ids, rewards by function,
reward, advantage, finish_reason). A resumed run first drops the lines of steps after the
checkpoint it resumes from (they are sampled again), writing the kept ones to a new file that then
replaces the old one, so a failure leaves the file whole."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from weft.components.rl.rounds import Rollout


class RolloutLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def resume_at(self, step: int) -> None:
        """Keep only the lines of steps up to `step` (the checkpoint resumed from); 0: a fresh run's empty file."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line)["step"] <= step]
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, self.path)

    def write(self, step: int, rollouts: Sequence[Rollout], names: Sequence[str], rewards: Sequence[float],
              advantages: Sequence[float]) -> None:
        """Append one line per rollout of the round first trained at `step`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            for rollout, reward, advantage in zip(rollouts, rewards, advantages):
                out.write(json.dumps({
                    "step": step, "prompt": rollout.row.prompt, "prompt_ids": rollout.row.token_ids,
                    "completion": rollout.completion, "completion_ids": rollout.completion_ids,
                    "rewards": {name: _number(value) for name, value in zip(names, rollout.rewards)},
                    "reward": _number(reward), "advantage": advantage, "finish_reason": rollout.finish_reason,
                }) + "\n")


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value
