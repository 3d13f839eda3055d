"""What the device and its kernels need: float8 support and shapes, FSDP's CPU offloading, ranks
sharing a GPU."""

from __future__ import annotations

from weft.components.config import ConfigError, JobConfig
from weft.components.distributed.processes import collective_backend
from weft.float8 import check_float8_compute, check_float8_support
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.precision import PrecisionPolicy


def check_cpu_offload(cfg: JobConfig, dims: ParallelDims, device_type: str) -> None:
    """parallelism.fsdp_cpu_offload needs FSDP's shards to offload, and a GPU to offload from."""
    if cfg.parallelism.fsdp_cpu_offload and not dims.fsdp_enabled:
        raise ConfigError(f"parallelism.fsdp_cpu_offload: offloads FSDP's shards, and this layout "
                          f"({dims.describe()}) has no FSDP (dp_shard x cp = 1)")
    if cfg.parallelism.fsdp_cpu_offload and device_type != "cuda":  # FSDP pins the shards it offloads
        raise ConfigError("parallelism.fsdp_cpu_offload: moves GPU memory to the CPU, and this run has no GPU")


def float8_warnings(cfg: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """What float8 support on this device and backend says (warnings), or a ConfigError."""
    f8 = cfg.float8
    if not f8.enable:
        return []
    try:
        return check_float8_support(
            device_type,
            run_backend(cfg, device_type) if dims.world_size > 1 else None,
            recipe=f8.recipe,
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
            precompute_float8_dynamic_scale_for_fsdp=f8.precompute_float8_dynamic_scale_for_fsdp,
            tp_degree=dims.tp,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run_backend(cfg: JobConfig, device_type: str) -> str:
    """The collective backend string this run's process group gets (components.distributed)."""
    p = cfg.parallelism
    return collective_backend(device_type, share_gpus=p.share_gpus, cpu_offload=p.fsdp_cpu_offload)


def check_gpu_compute(cfg: JobConfig, dims: ParallelDims, precision: PrecisionPolicy, device_type: str) -> None:
    """What the GPU's kernels need of the configured shapes and dtypes (float8's `_scaled_mm`),
    checked for the dry run's planned device too: a ConfigError, one line."""
    t, f8 = cfg.training, cfg.float8
    if not f8.enable:
        return
    try:
        check_float8_compute(device_type, f8.recipe, precision.compute_dtype, t.local_batch_size * t.seq_len // dims.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_shared_gpus(cfg: JobConfig, dims: ParallelDims, device_type: str) -> None:
    """Ranks sharing a GPU talk through gloo, which moves CUDA tensors well enough for FSDP and DDP
    but crashes under TP, CP and PP (all-gathers into one tensor, point-to-point sends: SIGSEGV,
    `writev Bad address`, `Pair is not connected` with torch 2.11 on an H100): a ConfigError."""
    if not cfg.parallelism.share_gpus or device_type != "cuda":
        return
    sizes = {"parallelism.tp": dims.tp, "parallelism.cp": dims.cp, "parallelism.pp": dims.pp}
    if bad := [f"{key} = {size}" for key, size in sizes.items() if size > 1]:
        raise ConfigError(f"parallelism.share_gpus: ranks sharing a GPU use gloo, which cannot all-gather CUDA "
                          f"tensors into one or send them point to point (crashes seen with torch 2.11 on an "
                          f"H100); use it with FSDP or DDP only, not {', '.join(bad)}")
