"""recipe/step.py: the step the benchmarks import is train.py's step, and the imports run one way."""

from __future__ import annotations

import ast

import torch

from benchmarks import eager_ops
from weft import train
from weft.components.config import parse_args
from weft.recipe.build import build_data
from weft.recipe.step import train_step

from tests.support import REPO

ARGS = ["--job.config_file", "debug_model", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", "1", "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard",
        "--no-checkpoint.enable"]


def test_benchmark_loss_at_step_1_equals_train_py(tmp_path):
    """benchmarks/eager_ops.py builds its model, optimizer and step from train.py's plan; fed the
    batch train.py reads first, its step-1 loss is train.py's logged loss, to the bit."""
    (logged,) = train.train(parse_args(ARGS + ["--job.dump_folder", str(tmp_path / "run")]))

    setup, plan = eager_ops.build_setup("debugmodel", seq_len=64, batch=2, optimizer="auto")
    loader, _ = build_data(plan, None, torch.device("cpu"))
    first = next(loader)
    loader.close()
    result = train_step(setup, [first])
    assert result.loss.item() == logged


def test_imports_run_one_way():
    """train.py -> recipe -> components, parallelisms, models, float8: nothing below imports up."""
    below = ["components", "parallelisms", "models", "float8"]
    for folder in below:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            names = [name.removeprefix("weft.") for name in names]
            upward = [name for name in names if name.split(".")[0] in ("recipe", "train", "tests", "benchmarks")]
            assert not upward, f"{path.relative_to(REPO)} imports {upward}"
