"""rollouts.jsonl in the dump folder: one line per completion a run trained on, so a user can read
what the policy writes (step, prompt, prompt_ids, completion, completion_ids, the objective's fields:
rewards by function, reward and advantage, or the divergence; finish_reason). A resumed run first drops
the lines of steps after the checkpoint it resumes from (they are sampled again), writing the kept
ones to a new file that then replaces the old one, so a failure leaves the file whole."""

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

    def write(self, step: int, rollouts: Sequence[Rollout], extra: Sequence[dict]) -> None:
        """Append one line per rollout of the round first trained at `step`, with the objective's `extra`
        fields (online RL: rewards, reward, advantage; distillation: the divergence)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            for rollout, fields in zip(rollouts, extra):
                out.write(json.dumps({
                    "step": step, "prompt": rollout.row.prompt, "prompt_ids": rollout.row.token_ids,
                    "completion": rollout.completion, "completion_ids": rollout.completion_ids,
                    **fields, "finish_reason": rollout.finish_reason}) + "\n")


def reward_fields(rollout: Rollout, names: Sequence[str], reward: float, advantage: float) -> dict:
    """An online RL line's fields: the reward of each function (null: it did not apply), their total, the advantage."""
    return {"rewards": {name: _number(value) for name, value in zip(names, rollout.rewards)},
            "reward": _number(reward), "advantage": advantage}


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value
