"""Fault tolerance's settings, checked before any process starts: the lighthouse's address, what
[fault_tolerance] cannot run with, the groups' description for the log, and the config's identity
that every group compares at each step."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import replace

from weft.components.config import ConfigError, JobConfig, to_toml
from weft.errors import UserError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
INSTALL = 'pip install "weft[ft]"'


class FaultToleranceError(UserError):
    """A replica group that cannot join the others: lighthouse unreachable, configs that differ."""


def lighthouse_address(cfg: JobConfig) -> str:
    return cfg.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def check_fault_tolerance(cfg: JobConfig, dp_replicate: int, device_type: str, *, check_environment: bool = True) -> None:
    """What fault tolerance cannot run with, one line each, before any process starts;
    check_environment=False (the dry run) leaves out the lighthouse's address and the package."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if ft.replica_id >= ft.replica_groups:
        raise ConfigError(f"fault_tolerance.replica_id = {ft.replica_id}: outside the {ft.replica_groups} replica "
                          f"groups (0 .. {ft.replica_groups - 1})")
    if ft.min_replica_groups > ft.replica_groups:
        raise ConfigError(f"fault_tolerance.min_replica_groups = {ft.min_replica_groups}: more than the "
                          f"{ft.replica_groups} replica groups, no step could commit")
    if dp_replicate > 1:
        raise ConfigError(f"parallelism.dp_replicate = {dp_replicate}: under fault tolerance the replica groups are "
                          "the replicas (fault_tolerance.replica_groups); set parallelism.dp_replicate = 1")
    if cfg.job.simulate_world_size:
        raise ConfigError("fault_tolerance.enable: job.simulate_world_size fakes every collective, the ones "
                          "across groups too; measure one group without fault tolerance")
    if not check_environment:
        return
    if ft.process_group == "nccl" and device_type != "cuda":
        raise ConfigError("fault_tolerance.process_group = 'nccl': needs GPUs, and this run has none; use 'gloo'")
    if not lighthouse_address(cfg):
        raise ConfigError(f"fault_tolerance.lighthouse: empty and {LIGHTHOUSE_ENV} is not set; give the "
                          "lighthouse's address, http://host:port (start one with torchft_lighthouse)")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"fault_tolerance.enable: torchft is not installed ({INSTALL})")


def describe_groups(cfg: JobConfig, group_world_size: int) -> str:
    """The layout across groups in one line, for the start-up log and the dry run."""
    ft = cfg.fault_tolerance
    sync = (f"weights synced by DiLoCo every {ft.sync_steps} steps (outer SGD lr {ft.outer_lr:g}, momentum "
            f"{ft.outer_momentum:g}{', Nesterov' if ft.outer_nesterov else ''})" if ft.semi_sync_method == "diloco"
            else "gradients averaged across the live groups every step")
    return (f"fault tolerance: replica group {ft.replica_id} of {ft.replica_groups}, each a torchrun job of "
            f"{group_world_size} ranks with this mesh ({ft.replica_groups * group_world_size} ranks in all); {sync}; "
            f"a step commits with {ft.min_replica_groups}+ groups; data: share {ft.replica_id} of {ft.replica_groups}")


def config_identity(cfg: JobConfig) -> int:
    """A 20-bit hash of what every group must agree on: the config less what names the group
    (replica_id, hostname, dump folder, description). Small enough that a float32 sum of it over
    many groups is exact."""
    same = replace(cfg, job=replace(cfg.job, dump_folder="", description="", config_file=""),
                   fault_tolerance=replace(cfg.fault_tolerance, replica_id=0, hostname=""))
    return int.from_bytes(hashlib.sha256(to_toml(same).encode()).digest()[:4], "big") >> 12
