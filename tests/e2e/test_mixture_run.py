"""A two-source mixture through train.py: its tokens follow the weights 3:1, a run killed by SIGKILL
resumes on the same losses and per-source tokens bit for bit, and a checkpoint of two ranks under
FSDP resumes in one process with the per-source tokens it saved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.dist_utils import free_port
from tests.support.failure_checks import python_path

SEQ, BATCH = 32, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two sources: comedies as text files, tragedies as token shards (made by prepare)."""
    root = tmp_path_factory.mktemp("mixture")
    plays = REPO / "assets/data/shakespeare"
    plays_of = {"comedies": ["as-you-like-it", "twelfth-night"], "tragedies_text": ["hamlet", "macbeth"]}
    for kind, names in plays_of.items():
        (root / kind).mkdir()
        for name in names:
            shutil.copy(plays / f"{name}.txt", root / kind)
    subprocess.run([sys.executable, "-m", "weft.components.data.prepare", "--source", str(root / "tragedies_text"),
                    "--tokenizer", str(REPO / "assets/tokenizer/shakespeare.model"), "--out", str(root / "tragedies")],
                   check=True, env=env(), capture_output=True)
    return root


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}


def train_args(corpus: Path, dump: Path, *extra: str) -> list[str]:
    return ["train.py", "--job.config_file", "debug_model", "--job.dump_folder", str(dump),
            "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH), "--metrics.log_freq", "1",
            "--no-metrics.enable_tensorboard", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--data.mixture", f"{corpus / 'comedies'}:3,{corpus / 'tragedies'}:1", *extra]


def records(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}") and '"train/loss"' in line]


def tokens(record: dict) -> dict[str, int]:
    return {k.removeprefix("data/tokens/"): v for k, v in record.items() if k.startswith("data/tokens/")}


def within_one_window_per_rank(record: dict, ranks: int) -> bool:
    drawn = tokens(record)
    total = sum(drawn.values())
    return (abs(drawn["comedies"] - 0.75 * total) <= SEQ * ranks
            and abs(drawn["tragedies"] - 0.25 * total) <= SEQ * ranks)


@pytest.mark.slow
def test_a_killed_mixture_run_resumes_on_the_same_losses_and_tokens(corpus, tmp_path):
    steps = ("--training.steps", "10")
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, *train_args(corpus, whole, *steps)], cwd=REPO, env=env(), check=True,
                   capture_output=True)
    expected = records(whole)
    assert len(expected) == 10 and all(within_one_window_per_rank(r, 1) for r in expected)
    assert tokens(expected[-1]) == {"comedies": 15 * SEQ, "tragedies": 5 * SEQ}  # 20 windows at 3:1

    dump = tmp_path / "killed"
    run = subprocess.Popen([sys.executable, *train_args(corpus, dump, *steps)], cwd=REPO, env=env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not records(dump) or records(dump)[-1]["step"] < 5:
            assert run.poll() is None and time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.02)
        run.kill()  # SIGKILL, between or inside steps 5-6
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    resumed = subprocess.run([sys.executable, *train_args(corpus, dump, *steps)], cwd=REPO, env=env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint: resumed from step" in resumed.stdout + resumed.stderr
    got = records(dump)
    assert [r["train/loss"] for r in got] == [r["train/loss"] for r in expected]
    assert [tokens(r) for r in got] == [tokens(r) for r in expected]


@pytest.mark.slow
def test_two_ranks_checkpoint_resumes_in_one_process_with_the_saved_tokens(corpus, tmp_path):
    dump = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    first = subprocess.run([*torchrun, *train_args(corpus, dump, "--training.steps", "4")], cwd=REPO, env=env(),
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = tokens(records(dump)[-1])
    assert sum(saved.values()) == 4 * 2 * BATCH * SEQ and within_one_window_per_rank(records(dump)[-1], 2)

    again = subprocess.run([sys.executable, *train_args(corpus, dump, "--training.steps", "8",
                                                        "--training.local_batch_size", str(2 * BATCH))],
                           cwd=REPO, env=env(), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint: resumed from step 4" in again.stdout + again.stderr
    after = records(dump)
    assert tokens(after[3]) == saved  # the two-rank run's records up to step 4 are kept
    for step, record in enumerate(after[4:], start=5):  # then every step draws 4 windows of one process
        assert sum(tokens(record).values()) == sum(saved.values()) + (step - 4) * 2 * BATCH * SEQ
        assert within_one_window_per_rank(record, 1), record


@pytest.mark.slow
def test_validation_mixture_gives_each_source_the_loss_of_validating_on_it_alone(corpus, tmp_path):
    """validation.mixture's loss of a source equals validation.dataset_path's loss on that source,
    in the same run otherwise (the same mixture trains the same model)."""
    from weft import train

    def validation(dump: Path, *extra: str) -> dict:
        argv = train_args(corpus, dump, "--training.steps", "2", "--no-checkpoint.enable", "--validation.enable",
                          "--validation.freq", "2", "--validation.steps", "1", *extra)[1:]
        assert train.main(argv) == 0
        lines = (dump / "metrics.jsonl").read_text().splitlines()
        return next(json.loads(line) for line in lines if "validation/" in line)

    both = validation(tmp_path / "both", "--validation.mixture", f"{corpus / 'comedies'},{corpus / 'tragedies_text'}")
    alone = {name: validation(tmp_path / name, "--validation.dataset_path", str(corpus / folder))
             for name, folder in (("comedies", "comedies"), ("tragedies", "tragedies_text"))}
    assert sorted(both) == ["step", "validation/loss/comedies", "validation/loss/tragedies",
                            "validation/perplexity/comedies", "validation/perplexity/tragedies"]
    assert both["validation/loss/comedies"] != both["validation/loss/tragedies"]  # a swap would show
    for name, record in alone.items():
        assert both[f"validation/loss/{name}"] == record["validation/loss"]
