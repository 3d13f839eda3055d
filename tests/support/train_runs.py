"""Short training runs for tests: their command-line arguments, and train.py's `train` run in this
process, optionally stopped as if SIGTERM arrived during a step."""

from __future__ import annotations

from pathlib import Path

from weft import train
from weft.components.config import parse_args
from weft.components.distributed.processes import Preemption


def run_args(dump: Path | str, *extra: str, config: str = "debug_model", steps: int = 4, seq_len: int = 32,
             batch: int = 2, checkpoint_every: int | None = None, data: Path | str | None = None) -> list[str]:
    """train.py's arguments for `steps` steps of `config` (a train_configs/ name) into `dump`, each of
    `batch` sequences of `seq_len` tokens, the loss logged every step, no TensorBoard; a checkpoint
    every `checkpoint_every` steps and `data` as data.dataset_path if given; then `extra` (a key
    given twice takes its last value, so `extra` may override any of these)."""
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", str(checkpoint_every)] if checkpoint_every else []
    dataset = ["--data.dataset_path", str(data)] if data is not None else []
    return ["--job.config_file", config, "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
            "--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", *checkpoints, *dataset, *extra]


class StopAfter(Preemption):
    """Acts as if SIGTERM arrived during step `step`."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.calls = step, 0

    def requested(self) -> bool:
        self.calls += 1
        return self.calls >= self.step


def run(cfg_args: list[str], stop_after: int | None = None) -> list[float]:
    if stop_after is None:
        return train.train(parse_args(cfg_args))
    return train.train(parse_args(cfg_args), make_preemption=lambda: StopAfter(stop_after))
