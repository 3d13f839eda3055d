"""Weights & Biases as an optional logger (`[metrics] enable_wandb`): rank 0 sends the scalars that
go to TensorBoard, at the same steps, with the run's config; a resumed run continues its wandb run.

`check_wandb` refuses a run that asks for it without the package (weft[wandb]), at plan time; a
wandb that cannot start stops the run at its first log with one line. The run id is kept in
<dump_folder>/wandb_run_id (`resume="allow"`); wandb's files go to $WANDB_DIR, else the dump
folder. What a resume shows there: docs/observability.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from weft.components.config import ConfigError, JobConfig, to_dict
from weft.errors import UserError

WANDB_HINT = 'pip install "weft[wandb]"'
RUN_ID_FILE = "wandb_run_id"


def check_wandb(cfg: JobConfig) -> None:
    """With metrics.enable_wandb: a ConfigError (one line) if wandb cannot be imported."""
    if not cfg.metrics.enable_wandb:
        return
    try:
        import wandb  # noqa: F401
    except Exception as error:  # ImportError, or a broken install failing inside
        raise ConfigError(f"metrics.enable_wandb = true: the wandb package cannot be imported "
                          f"({type(error).__name__}); {WANDB_HINT}, or set metrics.enable_wandb = false") from None


def wandb_run_name(cfg: JobConfig) -> str:
    """metrics.wandb_run_name, or the name of the dump folder."""
    return cfg.metrics.wandb_run_name or Path(cfg.job.dump_folder).resolve().name


class WandbLogger:
    """One wandb run, started at the first `log` (a run that fails before its first step writes
    nothing), with the id stored in the dump folder."""

    def __init__(self, cfg: JobConfig) -> None:
        self.dump = Path(cfg.job.dump_folder)
        self.project, self.name = cfg.metrics.wandb_project, wandb_run_name(cfg)
        self.config: dict[str, Any] = to_dict(cfg)
        self.run = None

    def _start(self) -> None:
        import wandb

        id_file = self.dump / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: wandb makes one
        self.dump.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=self.project, name=self.name, id=run_id, resume="allow",
                                  config=self.config, dir=os.environ.get("WANDB_DIR") or str(self.dump))
        except Exception as error:  # not logged in, no network, a bad project: one line, not a traceback
            first_line = (str(error).splitlines() or [type(error).__name__])[0]
            raise UserError(f"metrics.enable_wandb = true: wandb could not start a run ({type(error).__name__}: "
                            f"{first_line}); run `wandb login`, set WANDB_MODE=offline, or set "
                            "metrics.enable_wandb = false") from None
        id_file.write_text(self.run.id + "\n")

    def log(self, values: dict[str, float], step: int) -> None:
        if self.run is None:
            self._start()
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
