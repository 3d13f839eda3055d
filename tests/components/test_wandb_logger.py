"""Weights & Biases (offline mode): the same scalars as TensorBoard at the same steps, the run's
config, one wandb run id across a resume; without the package, a run that asks for it exits 2."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from weft import train
from weft.components.config import parse_args, to_dict

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run_args


def wandb_args(dump: Path, steps: int) -> list[str]:
    """A run logging to W&B and TensorBoard, a checkpoint every 2 steps."""
    return run_args(dump, "--metrics.enable_tensorboard", "--metrics.enable_wandb", steps=steps, seq_len=64,
                    checkpoint_every=2)


def tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    steps: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps[event.step][tag] = event.value
    return dict(steps)


@pytest.mark.slow
def test_wandb_records_what_tensorboard_records_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.support.wandb_records import finished_run_file, history, run_info

    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "run"
    # each run's offline folder apart: wandb names them by the second they start, which two short runs can share
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "first"))
    assert train.main(wandb_args(dump, 2)) == 0
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "resumed"))
    assert train.main(wandb_args(dump, 3)) == 0  # resumes from the step-2 checkpoint

    files = [finished_run_file(tmp_path / run) for run in ("first", "resumed")]
    run_id = (dump / "wandb_run_id").read_text().strip()
    assert [run_info(f)[0] for f in files] == [run_id, run_id]
    config = {key: value for key, value in run_info(files[0])[1].items() if key != "_wandb"}
    assert config == json.loads(json.dumps(to_dict(parse_args(wandb_args(dump, 2)))))

    logged = {step: values for f in files for step, values in history(f).items()}
    scalars = tensorboard_scalars(dump / "tb")
    assert sorted(logged) == sorted(scalars) == [1, 2, 3]
    for step, values in scalars.items():
        assert sorted(logged[step]) == sorted(values), step
        assert logged[step] == pytest.approx(values, rel=1e-6), step  # TensorBoard keeps float32
    assert {"time/remaining_seconds", "ranks/data_wait_seconds/0", "train/loss"} <= set(logged[3])


def test_enable_wandb_without_the_package_exits_2_writing_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a module it cannot find
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, wandb_args(tmp_path / "run", 2), capsys)
    assert_clean_failure(outcome, "metrics.enable_wandb = true: the wandb package cannot be imported",
                         before=before, root=tmp_path)
    assert 'pip install "weft[wandb]"' in outcome.stderr


def test_a_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from weft.components.observe.wandb_logger import WandbLogger
    from weft.errors import UserError

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    logger = WandbLogger(parse_args(wandb_args(tmp_path, 2)))
    with pytest.raises(UserError, match=r"^metrics.enable_wandb = true: wandb could not start a run \(UsageError: "
                                        r"api_key not configured .*\); run `wandb login`"):
        logger.log({"train/loss": 1.0}, 1)
    assert not (tmp_path / "wandb_run_id").exists()
