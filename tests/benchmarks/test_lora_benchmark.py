"""benchmarks/lora.py measures train.py's own step: fed the batch train.py reads first, its step-1
loss is train.py's logged loss, to the bit, in each fine-tuning mode."""

import pytest
import torch

from benchmarks import lora
from weft import train
from weft.components.config import parse_args
from weft.recipe.build import build_data
from weft.recipe.plan import RunPlan
from weft.recipe.step import train_step

ARGS = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "1",
        "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", "--no-checkpoint.enable"]


@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_lora_benchmark_loss_at_step_1_equals_train_py(tmp_path, mode):
    options = [*lora.MODES[mode], *ARGS]
    cfg = parse_args(["--job.config_file", "debug_model", *options, "--job.dump_folder", str(tmp_path / "run")])
    (logged,) = train.train(cfg)

    setup, _ = lora.build_setup([*options, "--job.dump_folder", str(tmp_path / "bench")], torch.device("cpu"))
    data_plan = RunPlan.from_config(cfg, 1, device_type="cpu")  # the benchmark's plan lists no data files
    loader, _ = build_data(data_plan, None, torch.device("cpu"))
    first = next(loader)
    loader.close()
    assert train_step(setup, [first]).loss.item() == logged
