"""train.py end to end: the debug model learns, metrics are written, bad input fails cleanly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from weft import train
from weft.components.config import parse_args
from weft.components.data import DataError
from weft.models import flavors
from weft.models.llama import LLAMA_FLAVORS

from tests.support import REPO
from tests.support.dist_utils import free_port


def quick_args(dump: Path, *extra: str) -> list[str]:
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(dump),
            "--training.seq_len", "64", "--metrics.log_freq", "1", *extra]


def run_train_py(*args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = (launcher or [sys.executable]) + ["train.py", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_train_reads_as_a_recipe_in_under_100_lines():
    """train() is the recipe users fork: plan, build, resume, loop, close, in one screenful or two;
    what grows goes into the importable step, plan and build."""
    import ast
    import inspect

    (function,) = ast.parse(inspect.getsource(train.train)).body
    assert function.end_lineno - function.lineno + 1 < 100


@pytest.mark.slow
def test_debug_model_loss_falls(tmp_path):
    losses = train.train(parse_args(quick_args(tmp_path, "--training.steps", "40", "--no-metrics.enable_tensorboard")))
    assert len(losses) == 40
    # Untrained, the model is about as good as uniform guessing over the 2048-token vocabulary.
    assert losses[0] == pytest.approx(math.log(2048), abs=0.6)
    # 40 steps of Shakespeare take off well over a nat (measured: about 7.8 -> 5.5).
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_metrics_reach_tensorboard_and_jsonl(tmp_path):
    train.train(parse_args(quick_args(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2")))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["train/tokens_per_second"] > 0 and r["memory/peak_gib"] > 0 for r in records)
    assert "train/mfu" not in records[0]  # unknown peak FLOPs on CPU: reported as unavailable

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_second", "memory/peak_gib"} <= tags
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["train/loss"] for r in records])
    assert (tmp_path / "config.toml").exists()


def test_tokenizer_larger_than_model_vocab_is_rejected(tmp_path, monkeypatch):
    small = replace(LLAMA_FLAVORS["debugmodel"], vocab_size=1000)
    monkeypatch.setitem(LLAMA_FLAVORS, "debugmodel", small)
    with pytest.raises(DataError, match=r"tokenizer's vocabulary \(2048\) is larger than .* \(1000\)"):
        train.train(parse_args(quick_args(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


SLOW = pytest.mark.slow  # each starts python train.py (4-5 s); three stay in the fast tier


@pytest.fixture(scope="module")
def bad_input_runs(request, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Each selected case of the bad-input test as its own `python train.py`, up to 4 at once (a
    process spends its 4-5 s importing, on one thread): case id -> (its dump folder, the result)."""
    cases = [item.callspec for item in request.session.items if item.module is request.module
             and getattr(item, "originalname", "") == "test_bad_input_is_one_line_nonzero_and_writes_nothing"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results, running = {}, []
    try:
        for number, case in enumerate(cases):
            dump = tmp_path_factory.mktemp(f"bad_input_{number}") / "out"
            command = [sys.executable, "train.py", "--job.config_file", "debug_model", "--job.dump_folder", str(dump),
                       *case.params["args"]]
            running.append((case.id, dump, subprocess.Popen(command, cwd=REPO, env=env, text=True,
                                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
            while len(running) == 4 or (running and number == len(cases) - 1):
                case_id, folder, process = running.pop(0)
                out, err = process.communicate(timeout=600)
                results[case_id] = folder, subprocess.CompletedProcess(process.args, process.returncode, out, err)
    finally:
        for _, _, process in running:
            process.kill()
            process.communicate()
    return results


@pytest.mark.parametrize(
    "args, message",
    [
        (["--job.config_file", "no_such.toml"], "job.config_file: 'no_such.toml' not found"),
        (["--training.stpes", "3"], "did you mean --training.steps"),
        (["--training.steps", "ten"], "--training.steps: expected an integer, got 'ten'"),
        pytest.param(["--training.steps", "0"], "--training.steps: must be >= 1, got 0", marks=SLOW),
        pytest.param(["--training.seq_len", "4096"], "training.seq_len = 4096 exceeds the maximum 2048", marks=SLOW),
        pytest.param(["--model.tokenizer_path", "missing.model"],
                     "model.tokenizer_path: no tokenizer file at 'missing.model'", marks=SLOW),
        pytest.param(["--data.dataset_path", "missing_dir"], "data.dataset_path: no file or folder at 'missing_dir'",
                     marks=SLOW),
        pytest.param(["--parallelism.tp", "3"], "world size 1 is not divisible by dp_replicate·cp·tp = 1·1·3",
                     marks=SLOW),
        pytest.param(["--parallelism.dp_shard", "2"],
                     "dp_replicate·dp_shard·cp·tp = 1·2·1·1 = 2 does not equal the world size 1", marks=SLOW),
        pytest.param(["--activation_checkpoint.mode", "fulll"], "expected one of none, full, selective", marks=SLOW),
    ],
)
def test_bad_input_is_one_line_nonzero_and_writes_nothing(request, bad_input_runs, args, message):
    dump, result = bad_input_runs[request.node.callspec.id]
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weft: error: "), result.stderr
    assert message in lines[0]
    assert not dump.exists()


def test_help_lists_options():
    result = run_train_py("--help")
    assert result.returncode == 0
    assert "--training.local_batch_size" in result.stdout and "--parallelism.dp_shard" in result.stdout


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "train_configs").glob("*.toml")))
def test_shipped_configs_parse_and_fit_their_model(config):
    cfg = parse_args(["--job.config_file", config])
    assert cfg.training.seq_len <= flavors()[cfg.model.flavor].max_seq_len


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    """The quickstart's distributed form: FSDP over two CPU processes, as a user types it."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    result = run_train_py(*quick_args(tmp_path, "--training.steps", "3"), launcher=torchrun)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "apply_fsdp: fsdp over dp_mesh size 2" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
