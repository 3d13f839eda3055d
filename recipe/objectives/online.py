"""What the online objectives (grpo.py, distillation.py) share: they train on completions the model
samples of prompt rows (data.format = prompts) during the run.

`prompt_loaders`: the stream of generation rounds and the validation prompts (every rank reads every
row; the ranks split each round). `OnlineParts`: the engine on the training model, the tokenizer's stop
tokens, the data-parallel group the ranks exchange completions over, and rollouts.jsonl.
`completion_batch`: rollouts as training rows, a prompt and its completion right-padded, labels and a
loss mask on the completion tokens, the sampling policy's log-probabilities at the same places.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from weft.components.config import ConfigError, JobConfig
from weft.components.data import Batch, DataError
from weft.components.data.prompt_rows import PromptRounds, PromptRow, read_prompt_rows
from weft.components.rl.rollouts import RolloutLog
from weft.components.rl.rounds import Rollout, Sampler, engine_sampler
from weft.components.training.loss import IGNORE_INDEX
from weft.recipe.config_keys import sampling_params

ROLLOUTS_FILE = "rollouts.jsonl"


def check_online(cfg: JobConfig, dims, name: str) -> None:
    """What neither online objective trains, each in one line naming its key: layouts the engine cannot
    decode in, validation that is not prompts, a mixture, fault tolerance, a row with no room to complete."""
    if dims.pp > 1 or dims.cp > 1:
        key, value = ("parallelism.pp", dims.pp) if dims.pp > 1 else ("parallelism.cp", dims.cp)
        raise ConfigError(f"{key} = {value}: training.objective = {name} samples with the generation engine, which "
                          "decodes neither through a pipeline nor across context shards; use fsdp, tp, ep or dp_replicate")
    if cfg.validation.enable and (cfg.validation.format or "prompts") != "prompts":
        raise ConfigError(f"validation.format = {cfg.validation.format}: training.objective = {name} validates on "
                          "prompts; set validation.format = prompts or leave it empty")
    if cfg.data.mixture:
        raise ConfigError(f"data.mixture: training.objective = {name} reads one prompt set; give data.dataset_path")
    if cfg.fault_tolerance.enable:
        raise ConfigError(f"fault_tolerance.enable: a retried step would sample its completions again; "
                          f"training.objective = {name} does not run under fault tolerance yet")
    if cfg.sampling.max_completion_length >= cfg.training.seq_len:
        raise ConfigError(f"sampling.max_completion_length = {cfg.sampling.max_completion_length}: a row is a "
                          f"prompt and its completion in training.seq_len = {cfg.training.seq_len} tokens; make it smaller")


def prompts_per_step(cfg: JobConfig, dp: int, generations: int) -> int:
    """Prompts an optimizer step's completions come from: local_batch_size x accumulation x dp / generations."""
    t = cfg.training
    return t.local_batch_size * t.gradient_accumulation_steps * dp // generations


def checked_rows(cfg: JobConfig, files, tokenizer) -> list[PromptRow]:
    """The prompt rows of `files`, each short enough for its completion within training.seq_len."""
    rows = read_prompt_rows(files, tokenizer)
    room = cfg.training.seq_len - cfg.sampling.max_completion_length
    for row in rows:
        if len(row.token_ids) > room:
            raise DataError(f"{row.where}: the prompt has {len(row.token_ids)} tokens; with "
                            f"sampling.max_completion_length {cfg.sampling.max_completion_length} a prompt holds at "
                            f"most {room} (training.seq_len - max_completion_length)")
    return rows


def prompt_loaders(plan, generations: int, steps_per_generation: int = 1, iterations: int = 1):
    """The prompt stream (rounds of `steps_per_generation` steps' prompts, each serving
    steps_per_generation x iterations steps) and {"": the validation rows} where validation is on."""
    cfg = plan.cfg
    rows = checked_rows(cfg, plan.data_files, plan.tokenizer)
    loader = PromptRounds(rows, round_prompts=prompts_per_step(cfg, plan.dims.dp, generations) * steps_per_generation,
                          steps_per_round=steps_per_generation * iterations,
                          micro_batches=cfg.training.gradient_accumulation_steps, seed=cfg.training.seed)
    validation = {}
    if plan.validation_files:
        validation_rows = checked_rows(cfg, plan.validation_files, plan.tokenizer)
        validation = {"": lambda: validation_rows}
    return loader, validation


@dataclass
class OnlineParts:
    """What an online objective samples with and writes to, built once per run."""

    sampler: Sampler
    tokenizer: object
    stop_ids: list[int]
    group: torch.distributed.ProcessGroup | None  # the data-parallel ranks (None: one process)
    dp_rank: int
    dp: int
    multiple: int  # a row's tokens are a multiple of it (tp's sequence split)
    rollouts: RolloutLog | None  # rank 0's rollouts.jsonl

    @classmethod
    def build(cls, plan, setup, meshes, max_batch_sequences: int | None = None) -> OnlineParts:
        cfg, tokenizer = plan.cfg, plan.tokenizer
        stop_ids = sorted(set(getattr(tokenizer, "stop_ids", ())) | {tokenizer.eos_id})
        rank = torch.distributed.get_rank() if meshes else 0
        return cls(engine_sampler(setup.model, sampling_params(cfg), stop_ids, tokenizer.decode, max_batch_sequences),
                   tokenizer, stop_ids, setup.loss_group, meshes.dp.get_local_rank() if meshes else 0, plan.dims.dp,
                   plan.dims.tp, RolloutLog(Path(cfg.job.dump_folder) / ROLLOUTS_FILE) if rank == 0 else None)

    def my_rows(self, rows: list[int], local_batch: int, micro_batches: int) -> list[list[int]]:
        """This rank's micro-batches of a step's completions `rows` (each rank a contiguous block)."""
        mine = rows[self.dp_rank * local_batch * micro_batches:][:local_batch * micro_batches]
        return [mine[m * local_batch:(m + 1) * local_batch] for m in range(micro_batches)]


def completion_batch(rollouts: list[Rollout], active: list[bool], multiple: int, device: torch.device
                     ) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """Prompt + completion rows, right-padded to a multiple of `multiple`: inputs, labels only at the
    completion tokens, the loss mask (0 for a row not `active`), and the sampling policy's
    log-probabilities at the same places."""
    width = max(len(r.row.token_ids) + len(r.completion_ids) for r in rollouts) - 1
    width = -(-width // multiple) * multiple
    inputs = torch.zeros(len(rollouts), width, dtype=torch.long)
    labels = torch.full((len(rollouts), width), IGNORE_INDEX, dtype=torch.long)
    mask, old = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    for n, (rollout, on) in enumerate(zip(rollouts, active)):
        tokens = rollout.row.token_ids + rollout.completion_ids
        start, length = len(rollout.row.token_ids) - 1, len(rollout.completion_ids)
        inputs[n, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        labels[n, start:start + length] = torch.tensor(rollout.completion_ids)
        old[n, start:start + length] = torch.tensor(rollout.logprobs)
        mask[n, start:start + length] = 1.0 if on else 0.0
    return Batch(inputs.to(device), labels.to(device)), mask.to(device), old.to(device)
