"""The tests' name for the library's multi-process helpers (components/distributed/cpu_ranks.py), and the layout
sweeps' runner."""

from collections.abc import Callable

from weft.components.distributed.cpu_ranks import free_port, run_distributed

__all__ = ["free_port", "run_by_world_size", "run_distributed"]


def run_by_world_size(worker: Callable, layouts: dict[str, tuple], root: str, timeout: float = 900) -> dict:
    """`worker(names, root)` once per world size (each layout's first item), in one process group of
    that size running those layouts in turn; rank 0's results of every group, merged."""
    results: dict = {}
    for world_size in sorted({layout[0] for layout in layouts.values()}):
        names = [name for name, layout in layouts.items() if layout[0] == world_size]
        results.update(run_distributed(worker, world_size, names, root, timeout=timeout)[0])
    return results


def data_parallel_degree(world_size: int, overrides: list[str]) -> int:
    """The data-parallel degree (replicate × shard) of a layout's command-line overrides on `world_size` ranks."""

    def degree(name: str, default: int) -> int:
        key = f"--parallelism.{name}"
        return int(overrides[overrides.index(key) + 1]) if key in overrides else default

    replicate, cp, tp = degree("dp_replicate", 1), degree("cp", 1), degree("tp", 1)
    shard = degree("dp_shard", -1)
    if shard == -1:
        shard = world_size // (replicate * cp * tp)
    return replicate * shard
