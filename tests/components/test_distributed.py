"""components/distributed/processes.py: which collective backend a rank gets, and what start-up says about GPUs."""

from __future__ import annotations

import pytest

from weft.components.distributed.processes import collective_backend, gpu_binding_line


@pytest.mark.parametrize("device_type, share_gpus, cpu_offload, expected", [
    ("cpu", False, False, "gloo"),
    ("cpu", False, True, "gloo"),
    ("cuda", False, False, "nccl"),
    # FSDP's offloaded gradients are CPU tensors that clipping all-reduces: NCCL cannot carry them
    ("cuda", False, True, "cuda:nccl,cpu:gloo"),
    ("cuda", True, False, "gloo"),  # ranks sharing a GPU: NCCL refuses two ranks on one device
    ("cuda", True, True, "gloo"),
])
def test_backend_string(device_type, share_gpus, cpu_offload, expected):
    assert collective_backend(device_type, share_gpus=share_gpus, cpu_offload=cpu_offload) == expected


def test_backend_string_is_one_torch_accepts():
    """torch parses the offload string into one backend per device type, as init_process_group will."""
    from torch.distributed import Backend

    config = Backend(collective_backend("cuda", cpu_offload=True))
    assert str(config) == "cuda:nccl,cpu:gloo"


def test_gpu_binding_is_stated_not_guessed():
    # One GPU visible to each of 8 processes (SLURM gpu-bind): NCCL, and start-up says what it assumed.
    bound = gpu_binding_line(local_world_size=8, visible_gpus=1, share_gpus=False)
    assert "bound GPUs to processes" in bound and "parallelism.share_gpus" in bound
    assert collective_backend("cuda") == "nccl"
    # One GPU each, all visible: nothing to say.
    assert gpu_binding_line(local_world_size=8, visible_gpus=8, share_gpus=False) is None
    assert gpu_binding_line(local_world_size=4, visible_gpus=8, share_gpus=False) is None
    # Sharing is chosen, and announced with its cost.
    shared = gpu_binding_line(local_world_size=2, visible_gpus=1, share_gpus=True)
    assert "share 1 visible GPU" in shared and "gloo" in shared
