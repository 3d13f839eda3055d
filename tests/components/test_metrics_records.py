"""What metrics.jsonl and TensorBoard record: the learning rate each step's update used, and
exactly one record per step even when a run is resumed after a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import weft.recipe.build as build_module
from weft import train

from tests.support.train_runs import run_args

WARMUP = ("--lr_scheduler.warmup_steps", "3")  # the rate changes at every one of the 4 steps


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_logged_lr_is_the_one_the_step_used(tmp_path, monkeypatch):
    used: list[float] = []
    real_build = build_module.build_optimizer

    def spying_build(model, cfg):
        optimizer = real_build(model, cfg)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
        return optimizer

    monkeypatch.setattr(build_module, "build_optimizer", spying_build)
    assert train.main(run_args(tmp_path, *WARMUP)) == 0
    assert len(used) == 4 and len(set(used)) > 1  # warmup: the rate changes every step
    assert [r["train/lr"] for r in records(tmp_path)] == pytest.approx(used, rel=1e-12)


def test_resumed_run_leaves_one_record_per_step(tmp_path):
    """A run killed after logging step 4 but before saving it resumes from step 2 and logs 3 and
    4 again: those replace the lost run's records, in metrics.jsonl and in TensorBoard."""
    assert train.main(run_args(tmp_path, *WARMUP, "--metrics.enable_tensorboard", checkpoint_every=2)) == 0
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")  # as if killed during the save of step 4
    lost = records(tmp_path)
    assert train.main(run_args(tmp_path, *WARMUP, "--metrics.enable_tensorboard", checkpoint_every=2)) == 0

    steps = [r["step"] for r in records(tmp_path)]
    assert steps == [1, 2, 3, 4]
    assert records(tmp_path)[:2] == lost[:2]  # the steps before the checkpoint are kept as they were

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
