"""The launch: how many ranks this process is part of, and what a simulated or seed-checkpoint run refuses."""

from __future__ import annotations

from weft.components.config import ConfigError, JobConfig
from weft.components.distributed.processes import launched_world_size


def check_launch(cfg: JobConfig) -> int:
    """The world size this process is part of (job.simulate_world_size, else torchrun's), after
    refusing what a simulated or seed-checkpoint run cannot do."""
    simulated, launched = cfg.job.simulate_world_size, launched_world_size()
    if simulated and launched > 1:
        raise ConfigError(f"job.simulate_world_size: simulates {simulated} ranks in one process; "
                          f"run it as python train.py, not {launched} processes")
    if simulated and (cfg.checkpoint.enable or cfg.checkpoint.initial_load_path):
        raise ConfigError("job.simulate_world_size: checkpoints need real ranks (a fake rank would save or load "
                          "garbage); set checkpoint.enable = false and checkpoint.initial_load_path = ''")
    world_size = simulated or launched
    if cfg.checkpoint.create_seed_checkpoint and world_size > 1:
        raise ConfigError("checkpoint.create_seed_checkpoint: run it as one process (python train.py), "
                          f"not {world_size}")
    return world_size
