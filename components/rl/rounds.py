"""A generation round: the round's prompts sampled `n` times each by the generation engine, every
completion scored by the reward functions, the results the same on every rank.

The data-parallel ranks split the prompts (each prompt's completions are seeded by its place in the
prompt stream, so who samples it changes nothing), score their own completions, and exchange them.
A reward function's error on any rank stops every rank with the same one line. `Sampler` is the
interface a generator outside the training processes (an inference server) would implement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from weft.components.data.prompt_rows import PromptRow
from weft.components.rl.grpo import nanstd
from weft.components.rl.rewards import RewardError, RewardFunction, compute_rewards
from weft.generation import Completion, SamplingParams, generate


@dataclass
class Rollout:
    """One completion of one prompt row, scored."""

    stream_index: int  # the prompt's place in the prompt stream: its completions' seed
    row: PromptRow
    completion: str | list[dict[str, str]]  # text, or one assistant message for a chat prompt
    completion_ids: list[int]  # what the loss covers, the stop token included
    logprobs: list[float]  # the sampling policy's, per completion token
    finish_reason: str  # stop | length
    rewards: list[float]  # one per reward function; NaN: it returned None


class Sampler(Protocol):
    """Completions of a list of prompts (token ids), n each: the engine, or a server implementing it."""

    def __call__(self, prompts: list[list[int]], n: int, prompt_indices: list[int]) -> list[list[Completion]]: ...


def engine_sampler(model: nn.Module, params: SamplingParams, stop_token_ids: Sequence[int],
                   decode: Callable[[list[int]], str], max_batch_sequences: int | None) -> Sampler:
    """The generation engine on the training model as it is laid out (adapters live, nothing merged)."""
    def sample(prompts: list[list[int]], n: int, prompt_indices: list[int]) -> list[list[Completion]]:
        return generate(model, prompts, params, n=n, stop_token_ids=stop_token_ids, decode=decode,
                        max_batch_sequences=max_batch_sequences, prompt_indices=prompt_indices)
    return sample


@dataclass
class RoundTimes:
    generate: float = 0.0
    score: float = 0.0


def sample_round(sampler: Sampler, prompts: list[tuple[int, PromptRow]], n: int, functions: Sequence[RewardFunction],
                 *, stop_token_ids: Sequence[int], decode: Callable[[list[int]], str],
                 group: dist.ProcessGroup | None = None) -> tuple[list[Rollout], RoundTimes]:
    """Every prompt's n scored completions, in prompt order (a prompt's n together), on every rank of
    `group` (the data-parallel ranks; None: this process alone)."""
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    share = -(-len(prompts) // size)
    mine = prompts[rank * share:(rank + 1) * share]
    times = RoundTimes()
    start = time.perf_counter()
    completions = sampler([row.token_ids for _, row in mine], n, [index for index, _ in mine])
    times.generate = time.perf_counter() - start
    stop = set(stop_token_ids)
    rollouts = [Rollout(index, row, _completion(row, c, stop, decode), list(c.token_ids), list(c.logprobs),
                        c.finish_reason, [])
                for (index, row), of_prompt in zip(mine, completions) for c in of_prompt]
    start, error = time.perf_counter(), None
    try:
        score(rollouts, functions)
    except RewardError as err:
        error = str(err)
    times.score = time.perf_counter() - start
    shares: list[Any] = [(rollouts, error)]
    if group is not None:
        shares = [None] * size
        dist.all_gather_object(shares, (rollouts, error), group=group)
    errors = [e for _, e in shares if e is not None]
    if errors:
        raise RewardError(errors[0])
    return [rollout for part, _ in shares for rollout in part], times


def _completion(row: PromptRow, completion: Completion, stop: set[int], decode: Callable[[list[int]], str]):
    """The completion's text (its stop token left out), as a message for a chat prompt."""
    ids = completion.token_ids
    text = decode(ids[:-1] if ids and completion.finish_reason == "stop" and ids[-1] in stop else ids)
    return [{"role": "assistant", "content": text}] if isinstance(row.prompt, list) else text


def score(rollouts: list[Rollout], functions: Sequence[RewardFunction]) -> None:
    """Each rollout's rewards, one per function, called once over all of them as TRL calls them."""
    if not rollouts:
        return
    keys = sorted({key for rollout in rollouts for key in rollout.row.columns})
    columns = {key: [rollout.row.columns.get(key) for rollout in rollouts] for key in keys}
    values = compute_rewards(functions, [r.row.prompt for r in rollouts], [r.completion for r in rollouts],
                             [r.completion_ids for r in rollouts], columns, [r.row.where for r in rollouts])
    for rollout, row in zip(rollouts, values.tolist()):
        rollout.rewards = row


def round_metrics(rollouts: list[Rollout], names: Sequence[str], rewards: torch.Tensor, std_zero: torch.Tensor
                  ) -> dict[str, float]:
    """TRL's round metrics: reward, reward_std, frac_reward_zero_std, rewards/{name}/mean|std, completions/*."""
    per_function = torch.tensor([r.rewards for r in rollouts], dtype=torch.float32).reshape(len(rollouts), len(names))
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
               "frac_reward_zero_std": std_zero.float().mean().item()}
    for f, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, f]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_function[:, f]).item()
    return {**metrics, **completion_metrics(rollouts)}


def completion_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """TRL's completions/*: lengths of all completions and of those that stopped, the share cut at the limit."""
    lengths = [len(r.completion_ids) for r in rollouts]
    terminated = [n for n, r in zip(lengths, rollouts) if r.finish_reason == "stop"]
    return {
        "completions/mean_length": sum(lengths) / len(lengths), "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": 1 - len(terminated) / len(lengths),
        "completions/mean_terminated_length": sum(terminated) / len(terminated) if terminated else 0.0,
        "completions/min_terminated_length": float(min(terminated)) if terminated else 0.0,
        "completions/max_terminated_length": float(max(terminated)) if terminated else 0.0,
    }
