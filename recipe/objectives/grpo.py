"""Online RL with verifiable rewards (training.objective = grpo, data.format = prompts): GRPO and its
variants (DAPO, Dr. GRPO, BNPO, GSPO, CISPO), as TRL 1.16's GRPOTrainer defines them (docs/rl.md).

A round's prompts are sampled rl.num_generations times each by the engine on the training model
(components/rl/rounds.py) and scored; their advantages (components/rl/grpo.py) train
rl.steps_per_generation optimizer steps, rl.num_iterations times, each step's completions split over
the data-parallel ranks and micro-batches, a row a prompt and its completion, the loss on the completion.
"""

from __future__ import annotations

import importlib.util
import math
import time

import torch

from weft.components.config import ConfigError, JobConfig
from weft.components.data.prompt_rows import RoundItem
from weft.components.rl.grpo import (
    GRPOOptions,
    StepCounts,
    clip_sums,
    completion_logps,
    micro_batch_loss,
    score_round,
    token_losses,
)
from weft.components.rl.rewards import load_reward_functions
from weft.components.rl.rollouts import reward_fields
from weft.components.rl.rounds import Rollout, RoundTimes, round_metrics, sample_round
from weft.recipe.objectives import Objective, register
from weft.recipe.objectives.frozen import Frozen
from weft.recipe.objectives.online import OnlineParts, check_online, completion_batch, prompt_loaders, prompts_per_step
from weft.recipe.step import StepSetup


class Round:
    """A round's rollouts, their rewards and advantages, and its metrics."""

    def __init__(self, index: int, rollouts: list[Rollout], functions, weights: torch.Tensor, options) -> None:
        self.index, self.rollouts = index, rollouts
        per_function = torch.tensor([r.rewards for r in rollouts], dtype=torch.float32)
        scores = score_round(per_function, weights, options.num_generations, options.scale_rewards)
        self.rewards, self.advantages = scores.rewards, scores.advantages
        self.metrics = round_metrics(rollouts, [f.name for f in functions], scores.rewards, scores.std_zero)
        self.written = False


@register
class GRPO(Objective):
    """The GRPO family's objective of [rl]; its metrics are TRL's (reward, rewards/*, completions/*,
    entropy, kl, clip_ratio/*, num_tokens) and the step's generation share and the seconds it spent
    generating and scoring (0 on a step that trains on an earlier step's round)."""

    name = "grpo"
    formats = default_for = ("prompts",)
    section = "rl"

    def __init__(self, cfg: JobConfig, functions, parts: OnlineParts, reference=None) -> None:
        rl, t = cfg.rl, cfg.training
        self.rl, self.functions, self.parts = rl, functions, parts
        self.options = GRPOOptions(rl.loss_type, rl.importance_sampling_level, rl.epsilon, rl.epsilon_high or None,
                                   rl.beta, cfg.sampling.max_completion_length)
        self.weights = torch.tensor(rl.reward_weights or [1.0] * len(functions), dtype=torch.float32)
        self.temperature = cfg.sampling.temperature
        self.local_batch, self.micro_batches = t.local_batch_size, t.gradient_accumulation_steps
        self.reference = reference
        self.validation_prompts = cfg.validation.steps * prompts_per_step(cfg, parts.dp, rl.num_generations)
        self.round: Round | None = None
        self.step_index, self.num_tokens = 0, 0

    @classmethod
    def check(cls, cfg: JobConfig, dims) -> None:
        """What GRPO cannot train, each in one line naming its key."""
        rl, t = cfg.rl, cfg.training
        check_online(cfg, dims, cls.name)
        if not rl.reward_functions:
            raise ConfigError("rl.reward_functions: empty; name at least one (math_answer, format, or module:function)")
        if rl.reward_weights and len(rl.reward_weights) != len(rl.reward_functions):
            raise ConfigError(f"rl.reward_weights: {len(rl.reward_weights)} weights for {len(rl.reward_functions)} "
                              "reward functions; expected one per function (or none: 1 each)")
        if rl.num_generations < 2 and rl.scale_rewards != "none":
            raise ConfigError(f"rl.num_generations = {rl.num_generations}: rl.scale_rewards = {rl.scale_rewards} "
                              "divides by a standard deviation over completions, which needs at least 2 per prompt")
        completions = t.local_batch_size * t.gradient_accumulation_steps * dims.dp
        if completions % rl.num_generations:
            raise ConfigError(f"rl.num_generations = {rl.num_generations}: a step trains training.local_batch_size "
                              f"x gradient_accumulation_steps x dp = {completions} completions, which must be whole "
                              "groups; make it a multiple of num_generations")
        if "math_answer" in rl.reward_functions and importlib.util.find_spec("math_verify") is None:
            raise ConfigError('rl.reward_functions: math_answer needs math-verify: pip install "weft[rl]"')
        load_reward_functions(rl.reward_functions, answer_tag=rl.answer_tag)  # each imports, or one line says why

    @classmethod
    def frozen(cls, cfg: JobConfig) -> Frozen | None:
        """The reference of β > 0: the policy with its adapters off under LoRA without rl.reference_path, else a copy."""
        if cfg.rl.beta == 0:
            return None
        mode = "adapters_off" if cfg.lora.enable and not cfg.rl.reference_path else "copy"
        return Frozen("rl reference", mode, cfg.rl.reference_path, "rl.reference_path")

    generation_note = "each generation round, beside the weights and optimizer state"

    @classmethod
    def generation_rows(cls, cfg: JobConfig, dims) -> int:
        """A round's completions on one data-parallel rank, in batches of at most rl.max_batch_sequences."""
        prompts = prompts_per_step(cfg, dims.dp, cfg.rl.num_generations) * cfg.rl.steps_per_generation
        rows = -(-prompts // dims.dp) * cfg.rl.num_generations
        return min(rows, cfg.rl.max_batch_sequences or rows)

    @classmethod
    def describe_rows(cls, rows: int) -> str:
        return f"{rows} completions"

    @classmethod
    def loaders(cls, plan, meshes):
        """The prompt stream in rounds of rl.steps_per_generation steps, each trained rl.num_iterations times."""
        rl = plan.cfg.rl
        return prompt_loaders(plan, rl.num_generations, rl.steps_per_generation, rl.num_iterations)

    @classmethod
    def build(cls, plan, setup: StepSetup, meshes, device: torch.device) -> GRPO:
        cfg = plan.cfg
        functions = load_reward_functions(cfg.rl.reward_functions, answer_tag=cfg.rl.answer_tag)
        objective = cls(cfg, functions, OnlineParts.build(plan, setup, meshes, cfg.rl.max_batch_sequences or None))
        frozen = cls.frozen(cfg)
        if frozen is not None:
            objective.reference = frozen.build(plan, setup, meshes, device, objective.token_logps)
        return objective

    def token_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return completion_logps(logits, labels, self.temperature)[0]

    def prepare(self, plan, run, start_step: int) -> None:
        """Where the step count starts; rollouts.jsonl keeps only the lines of the steps a resumed run keeps."""
        self.step_index = start_step
        if self.parts.rollouts is not None:
            self.parts.rollouts.resume_at(start_step)

    def step(self, setup: StepSetup, micro_batches: list[RoundItem], on_phase) -> tuple[torch.Tensor, dict[str, float]]:
        """Sample and score a round where this step starts one, then forward and backward this rank's
        share of the step's completions."""
        started, times = time.perf_counter(), RoundTimes()
        self.step_index += 1
        item = micro_batches[0]
        if self.round is None or self.round.index != item.round:
            on_phase("generate")
            rollouts, times = sample_round(self.parts.sampler, item.prompts, self.rl.num_generations, self.functions,
                                           stop_token_ids=self.parts.stop_ids, decode=self.parts.tokenizer.decode,
                                           group=self.parts.group)
            self.round = Round(item.round, rollouts, self.functions, self.weights, self.rl)
            self.num_tokens += sum(len(r.row.token_ids) + len(r.completion_ids) for r in rollouts)
            on_phase("forward")
        rows = self.step_rows(item.step_in_round % self.rl.steps_per_generation)
        counts = StepCounts(sequences=len(rows), tokens=float(sum(self.active(i) for i in rows)),
                            micro_batches=self.micro_batches * self.parts.dp)
        step_loss = torch.zeros((), device=setup.device)
        sums = None
        for micro in self.parts.my_rows(rows, self.local_batch, self.micro_batches):
            loss, micro_sums = self.micro_batch(setup, micro, counts, on_phase)
            step_loss += loss
            sums = micro_sums if sums is None else {k: _combine(k, sums[k], v) for k, v in micro_sums.items()}
        metrics = {**self.round.metrics, **self.reduce(sums), "num_tokens": float(self.num_tokens),
                   "generation_share": times.generate / (time.perf_counter() - started),
                   "generation_seconds": times.generate, "score_seconds": times.score}
        self.write_rollouts()
        return step_loss, metrics

    def step_rows(self, k: int) -> list[int]:
        """The round's completions step k of the round trains on (indices into the round)."""
        per_step = len(self.round.rollouts) // self.rl.steps_per_generation
        return list(range(k * per_step, (k + 1) * per_step))

    def active(self, i: int) -> int:
        """Completion i's tokens in the loss: none for a cut one under rl.mask_truncated_completions."""
        rollout = self.round.rollouts[i]
        masked = self.rl.mask_truncated_completions and rollout.finish_reason == "length"
        return 0 if masked else len(rollout.completion_ids)

    def micro_batch(self, setup: StepSetup, rows: list[int], counts: StepCounts, on_phase
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of one micro-batch of the round's completions `rows`."""
        batch, mask, old = completion_batch([self.round.rollouts[i] for i in rows], [self.active(i) > 0 for i in rows],
                                            self.parts.multiple, setup.device)
        advantages = self.round.advantages[rows].to(setup.device)
        reference = self.reference(batch) if self.reference is not None else None
        with setup.loss_context():
            with setup.forward_context():
                logits = setup.forward(setup.model, batch)
            logps, entropy = completion_logps(logits, batch.labels, self.temperature, entropy=True)
            del logits
            on_policy = self.rl.steps_per_generation * self.rl.num_iterations == 1
            losses = token_losses(self.options, logps, logps.detach() if on_policy else old, advantages, mask,
                                  reference)
            loss = micro_batch_loss(self.options, losses.loss, mask, counts) * setup.grad_ranks
            on_phase("backward")
            loss.backward()
        on_phase("forward")
        sums = {"entropy": (entropy * mask).sum(), "tokens": mask.sum(),
                "kl": (losses.kl * mask).sum() if losses.kl is not None else mask.new_zeros(()),
                **clip_sums(self.options, losses.ratio.detach(), advantages, mask)}
        return loss.detach(), sums

    def reduce(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's token metrics over every rank: entropy, kl, clip_ratio/* (TRL's names)."""
        added = torch.stack([sums[k] for k in ("entropy", "tokens", "kl", "low", "high", "region", "count")]).float()
        low_min, high_max = sums["low_min"].float().reshape(1), sums["high_max"].float().reshape(1)
        group = self.parts.group
        if group is not None:
            torch.distributed.all_reduce(added, group=group)
            torch.distributed.all_reduce(low_min, op=torch.distributed.ReduceOp.MIN, group=group)
            torch.distributed.all_reduce(high_max, op=torch.distributed.ReduceOp.MAX, group=group)
        entropy, tokens, kl, low, high, region, count = added.tolist()
        metrics = {"entropy": entropy / max(tokens, 1.0)}
        if self.options.beta != 0:
            metrics["kl"] = kl / max(tokens, 1.0)
        if self.options.loss_type == "cispo":
            return {**metrics, "cispo_clip_ratio": high / max(count, 1.0)}
        return {**metrics, "clip_ratio/low_mean": low / max(count, 1.0), "clip_ratio/high_mean": high / max(count, 1.0),
                "clip_ratio/region_mean": region / max(count, 1.0),
                "clip_ratio/low_min": _finite(low_min.item()), "clip_ratio/high_max": _finite(high_max.item())}

    def write_rollouts(self) -> None:
        """The round's lines in rollouts.jsonl (rank 0), once, at the step that first trained on it."""
        if self.parts.rollouts is not None and not self.round.written:
            names = [f.name for f in self.functions]
            self.parts.rollouts.write(self.step_index, self.round.rollouts, [
                reward_fields(r, names, reward, advantage) for r, reward, advantage in
                zip(self.round.rollouts, self.round.rewards.tolist(), self.round.advantages.tolist())])
        self.round.written = True

    def log_note(self, metrics: dict[str, float]) -> str:
        length = metrics.get("completions/mean_length")
        return f"  reward {metrics['reward']:.4f}" + (f"  completion_length {length:.1f}" if length is not None else "")

    def validate(self, run, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
        """The reward of num_generations completions of each of the first validation prompts (the
        sampling options and seed of training, each prompt seeded by its place in the file)."""
        rows = run.validation_loaders[""]()[:self.validation_prompts]
        rollouts, _ = sample_round(self.parts.sampler, list(enumerate(rows)), self.rl.num_generations, self.functions,
                                   stop_token_ids=self.parts.stop_ids, decode=self.parts.tokenizer.decode,
                                   group=self.parts.group)
        scored = Round(-1, rollouts, self.functions, self.weights, self.rl)
        return {}, {k: v for k, v in scored.metrics.items() if k.startswith(("reward", "completions/mean_length"))}


def _combine(key: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.minimum(a, b) if key == "low_min" else torch.maximum(a, b) if key == "high_max" else a + b


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
