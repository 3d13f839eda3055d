"""training.objective: an objective is a module of its own. This module defines a third one (a
token-weighted loss), registers it and trains it through train.py without any change to recipe/:
its first step's loss equals a transformers-only computation of the same weighted loss on the same
batch, and its own metric is logged. And the one-line refusals of a name, or a data format, the objective cannot train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from weft import train
from weft.components.training.loss import IGNORE_INDEX
from weft.recipe.objectives import OBJECTIVES, Objective, register

from tests.support import REPO
from tests.support.failure_checks import assert_clean_failure, run_in_process
from tests.support.hf_folders import tiny_hf_folder
from tests.support.hf_tokenizer import build_tokenizer_folder
from tests.support.train_runs import run, run_args

transformers = pytest.importorskip("transformers")


def position_weights(labels: torch.Tensor) -> torch.Tensor:
    """Each supervised token weighted by its position + 1 (later tokens count more), 0 where ignored."""
    positions = torch.arange(1, labels.shape[1] + 1, dtype=torch.float32, device=labels.device)
    return positions.expand_as(labels) * (labels != IGNORE_INDEX)


class TokenWeighted(Objective):
    """sum(w * token loss) / sum(w) over the step's micro-batches, w from `position_weights`
    (one process: no loss group to reduce the weights over)."""

    name = "token_weighted"
    formats = ("text",)
    seen: list = []  # the placed micro-batches, for the reference computation

    def step(self, setup, micro_batches, on_phase):
        total = sum(position_weights(b.labels).sum() for b in micro_batches)
        step_loss = torch.zeros((), device=setup.device)
        for batch in micro_batches:
            self.seen.append(batch)
            with setup.forward_context():
                logits = setup.forward(setup.model, batch)
            losses = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), reduction="none",
                                     ignore_index=IGNORE_INDEX)
            loss = (losses * position_weights(batch.labels).flatten()).sum() / total
            on_phase("backward")
            loss.backward()
            step_loss += loss.detach()
        supervised = sum((b.labels != IGNORE_INDEX).sum() for b in micro_batches)
        return step_loss, {"weights/mean": (total / supervised).item()}

    def log_note(self, metrics):
        return f"  mean_weight {metrics['weights/mean']:.2f}"


@pytest.fixture
def token_weighted():
    register(TokenWeighted)
    TokenWeighted.seen.clear()
    yield TokenWeighted
    del OBJECTIVES[TokenWeighted.name]


def test_a_third_objective_trains_through_train_py(tmp_path, token_weighted):
    tokenizer = build_tokenizer_folder(tmp_path / "tok")
    folder = tiny_hf_folder(tmp_path / "policy", tokenizer)
    losses = run(run_args(tmp_path / "run", "--training.objective", "token_weighted", "--model.flavor", "from_hf_config",
                          "--checkpoint.initial_load_path", str(folder), "--model.tokenizer_path", str(tokenizer),
                          "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3",
                          "--lr_scheduler.warmup_steps", "1", data=REPO / "assets/data/shakespeare", steps=3))
    assert len(losses) == 3 and len(token_weighted.seen) == 3 and losses[-1] < losses[0]

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    batch = token_weighted.seen[0]
    assert batch.document_ids is None and batch.positions is None
    with torch.no_grad():
        logits = model(batch.inputs).logits.float()
    per_token = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    weights = position_weights(batch.labels).flatten()
    assert losses[0] == pytest.approx(((per_token * weights).sum() / weights.sum()).item(), abs=1e-5)
    assert losses[0] != pytest.approx(per_token.mean().item(), abs=1e-3), "the weights must matter"
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["weights/mean"] == pytest.approx(weights.sum().item() / (batch.labels != IGNORE_INDEX).sum().item())


@pytest.mark.parametrize("extra, expected", [
    (["--training.objective", "nope"], "training.objective = nope: expected auto or one of distillation, grpo, next_token, preference"),
    (["--training.objective", "preference"],
     "data.format = text: training.objective = preference trains on data.format preference"),
    (["--training.objective", "next_token", "--data.format", "preference"],
     "data.format = preference: training.objective = next_token trains on data.format text or chat or "
     "prompt_completion"),
    (["--data.format", "chat", "--validation.enable", "--validation.format", "preference"],
     "validation.format = preference: training.objective = next_token validates on text or chat or "
     "prompt_completion"),
])
def test_an_objective_refuses_data_it_cannot_train(tmp_path, capsys, extra, expected):
    argv = run_args(Path(tmp_path) / "dump", *extra)
    assert_clean_failure(run_in_process(train.main, argv, capsys), expected)
