"""On-policy distillation (training.objective = distillation, data.format = prompts), as TRL 1.16's
DistillationTrainer defines it (docs/distillation.md): each step the student samples one completion of
each of the step's prompts with the engine ([sampling]); the teacher, a frozen model of any family weft
builds with the student's vocabulary, is run on the same rows; the loss is the generalized JSD of the two
next-token distributions at every completion token (components/training/distillation.py), summed and
divided by the completion tokens of the whole optimizer step, so no layout or accumulation changes it.
Both models hand over their final hidden states and heads (`Backend.forward_head`), projected a chunk of
completion positions at a time: neither model's logits are whole for the micro-batch.
"""

from __future__ import annotations

import time

import torch

from weft.components.config import ConfigError, JobConfig
from weft.components.data.prompt_rows import RoundItem
from weft.components.hf import model_args_for_run
from weft.components.rl.rounds import completion_metrics, sample_round
from weft.components.training.distillation import head_divergence
from weft.errors import UserError
from weft.models import spec_for_args
from weft.recipe.objectives import Objective, register
from weft.recipe.objectives.frozen import Frozen
from weft.recipe.objectives.online import OnlineParts, check_online, completion_batch, prompt_loaders, prompts_per_step
from weft.recipe.step import StepSetup


@register
class Distillation(Objective):
    """The student's divergence from the teacher on its own completions; metrics: the loss, TRL's
    completions/*, entropy, num_tokens, and the step's generation share."""

    name = "distillation"
    formats = ("prompts",)
    section = "distillation"
    generation_note = "each step's completions, beside the weights, optimizer state and teacher"

    def __init__(self, cfg: JobConfig, parts: OnlineParts, teacher=None, forward_head=None) -> None:
        d, t = cfg.distillation, cfg.training
        self.parts, self.teacher, self.forward_head = parts, teacher, forward_head
        self.beta, self.chunk, self.temperature = d.beta, d.chunk_positions, cfg.sampling.temperature
        self.local_batch, self.micro_batches = t.local_batch_size, t.gradient_accumulation_steps
        self.validation_prompts = cfg.validation.steps * prompts_per_step(cfg, parts.dp, 1)
        self.step_index, self.num_tokens = 0, 0

    @classmethod
    def check(cls, cfg: JobConfig, dims) -> None:
        """What distillation cannot train, each in one line naming its key; the teacher's vocabulary."""
        check_online(cfg, dims, cls.name)
        if cfg.sampling.temperature <= 0:
            raise ConfigError(f"sampling.temperature = {cfg.sampling.temperature}: distillation divides both models' "
                              "logits by it (and samples with it); use a temperature > 0")
        teacher = teacher_args(cfg)
        student = model_args_for_run(cfg.model.flavor, cfg.checkpoint.initial_load_path, cfg.model.backend,
                                     cfg.model.trust_remote_code)
        if teacher.vocab_size != student.vocab_size:
            raise ConfigError(f"distillation.teacher_path: the teacher's vocabulary ({teacher.vocab_size} tokens) is not "
                              f"the student's ({student.vocab_size}); distillation compares the two distributions "
                              "token by token and needs one vocabulary")

    @classmethod
    def frozen(cls, cfg: JobConfig) -> Frozen:
        """The teacher: a frozen copy of distillation.teacher_path's model, sharded as the student is."""
        return Frozen("distillation teacher", "copy", cfg.distillation.teacher_path, "distillation.teacher_path",
                      model_args=teacher_args)

    @classmethod
    def generation_rows(cls, cfg: JobConfig, dims) -> int:
        return -(-prompts_per_step(cfg, dims.dp, 1) // dims.dp)

    @classmethod
    def describe_rows(cls, rows: int) -> str:
        return f"{rows} completions"

    @classmethod
    def loaders(cls, plan, meshes):
        return prompt_loaders(plan, 1)

    @classmethod
    def build(cls, plan, setup: StepSetup, meshes, device: torch.device) -> Distillation:
        model = cls.frozen(plan.cfg).copy(plan, meshes, device)
        teacher_head = spec_for_args(teacher_args(plan.cfg)).backend.forward_head  # its backend may differ

        @torch.no_grad()
        def teacher(batch):
            """The teacher's final hidden states [B, T, D'] and its head (rows -> logits)."""
            with setup.forward_context():
                return teacher_head(model, batch.inputs, batch.positions, batch.document_ids,
                                    lambda hidden, project: (hidden, project))

        return cls(plan.cfg, OnlineParts.build(plan, setup, meshes), teacher, plan.spec.backend.forward_head)

    def divergence(self, setup: StepSetup, batch, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's divergence and entropy per position of `batch`, from inside its forward."""
        teacher_hidden, teacher_project = self.teacher(batch)

        def use(hidden, project):
            return head_divergence(hidden, project, teacher_hidden, teacher_project, mask, self.beta,
                                   self.temperature, self.chunk)

        with setup.loss_context(), setup.forward_context():
            return self.forward_head(setup.model, batch.inputs, batch.positions, batch.document_ids, use)

    def prepare(self, plan, run, start_step: int) -> None:
        self.step_index = start_step
        if self.parts.rollouts is not None:
            self.parts.rollouts.resume_at(start_step)

    def step(self, setup: StepSetup, micro_batches: list[RoundItem], on_phase) -> tuple[torch.Tensor, dict[str, float]]:
        """Sample the step's completions, then forward and backward this rank's share of the divergence."""
        started = time.perf_counter()
        self.step_index += 1
        on_phase("generate")
        rollouts, times = sample_round(self.parts.sampler, micro_batches[0].prompts, 1, [],
                                       stop_token_ids=self.parts.stop_ids, decode=self.parts.tokenizer.decode,
                                       group=self.parts.group)
        on_phase("forward")
        self.num_tokens += sum(len(r.row.token_ids) + len(r.completion_ids) for r in rollouts)
        tokens = float(sum(len(r.completion_ids) for r in rollouts))
        step_loss, sums, means = torch.zeros((), device=setup.device), torch.zeros(3, device=setup.device), {}
        for rows in self.parts.my_rows(list(range(len(rollouts))), self.local_batch, self.micro_batches):
            batch, mask, _ = completion_batch([rollouts[i] for i in rows], [True] * len(rows), self.parts.multiple,
                                              setup.device)
            divergence, entropy = self.divergence(setup, batch, mask)
            loss = (divergence * mask).sum() / max(tokens, 1.0) * setup.grad_ranks
            on_phase("backward")
            with setup.loss_context():
                loss.backward()
            on_phase("forward")
            step_loss += loss.detach()
            sums += torch.stack([(divergence * mask).sum().detach(), (entropy * mask).sum(), mask.sum()])
            means.update(zip(rows, ((divergence * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()))
        if self.parts.group is not None:
            torch.distributed.all_reduce(sums, group=self.parts.group)
        self.write_rollouts(rollouts, means)
        divergence_sum, entropy_sum, count = sums.tolist()
        return step_loss, {**completion_metrics(rollouts), "entropy": entropy_sum / max(count, 1.0),
                           "divergence": divergence_sum / max(count, 1.0), "num_tokens": float(self.num_tokens),
                           "generation_share": times.generate / (time.perf_counter() - started),
                           "generation_seconds": times.generate}

    def write_rollouts(self, rollouts, means: dict[int, float]) -> None:
        """rollouts.jsonl (rank 0): each completion with its mean divergence per token."""
        if self.parts.group is not None:
            shares = [None] * torch.distributed.get_world_size(self.parts.group)
            torch.distributed.all_gather_object(shares, means, group=self.parts.group)
            means = {k: v for share in shares for k, v in share.items()}
        if self.parts.rollouts is not None:
            self.parts.rollouts.write(self.step_index, rollouts, [{"divergence": means[i]} for i in range(len(rollouts))])

    def log_note(self, metrics: dict[str, float]) -> str:
        length = metrics.get("completions/mean_length")
        return f"  divergence {metrics['divergence']:.4f}" + (
            f"  completion_length {length:.1f}" if length is not None else "")

    @torch.no_grad()
    def validate(self, run, cfg: JobConfig) -> tuple[dict[str, float], dict[str, float]]:
        """The student's divergence from the teacher per token of its own completions of the first
        validation prompts (each seeded by its place in the file)."""
        setup = run.step
        rows = run.validation_loaders[""]()[:self.validation_prompts]
        rollouts, _ = sample_round(self.parts.sampler, list(enumerate(rows)), 1, [], stop_token_ids=self.parts.stop_ids,
                                   decode=self.parts.tokenizer.decode, group=self.parts.group)
        sums = torch.zeros(2, device=setup.device)
        setup.model.eval()
        for rows in self.parts.my_rows(list(range(len(rollouts))), self.local_batch, self.micro_batches):
            batch, mask, _ = completion_batch([rollouts[i] for i in rows], [True] * len(rows), self.parts.multiple,
                                              setup.device)
            divergence, _ = self.divergence(setup, batch, mask)
            sums += torch.stack([(divergence * mask).sum(), mask.sum()])
        setup.model.train()
        if self.parts.group is not None:
            torch.distributed.all_reduce(sums, group=self.parts.group)
        return {}, {"divergence": (sums[0] / sums[1].clamp(min=1)).item(),
                    "completions/mean_length": completion_metrics(rollouts)["completions/mean_length"]}


def teacher_args(cfg: JobConfig):
    """The teacher's model arguments: distillation.teacher_flavor's, or read from distillation.teacher_path
    (its config.json, or the one its weft run recorded) with teacher_flavor = from_hf_config."""
    d = cfg.distillation
    if not d.teacher_path:
        raise ConfigError("distillation.teacher_path: empty; name the teacher (a Hugging Face folder or a weft "
                          "checkpoint step)")
    try:
        return model_args_for_run(d.teacher_flavor, d.teacher_path, d.teacher_backend, cfg.model.trust_remote_code)
    except UserError as err:
        raise ConfigError(f"distillation.teacher_path = {d.teacher_path!r}: "
                          f"{str(err).replace('checkpoint.initial_load_path', 'the teacher')}") from None
