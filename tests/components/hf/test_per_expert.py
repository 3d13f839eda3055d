"""Per-expert Hugging Face tensors (Qwen3-MoE's `mlp.experts.{j}.gate_proj.weight`) in a sharded
model: under expert parallelism or FSDP each rank reads only the experts it holds, the sharded
model equals the one loaded in one process, and its export writes transformers' own tensors back."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.components.hf import load_hf_into_model, model_args_from_hf_folder, save_hf_model
from weft.models.qwen3 import Transformer

from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import tiny_qwen3_hf_folder

N_EXPERTS, RANKS = 8, 2


def load_sharded(layout: str, folder: str, reference: str, out: str) -> tuple[list[str], dict[str, set[int]]]:
    """Worker: meta → apply_ep or apply_fsdp → to_empty → load_hf_into_model → save_hf_model;
    returns (parameters whose full tensor differs from the one-process load, the expert indices
    of each expert projection this rank read from disk)."""
    import weft.components.hf.load as load
    from weft.parallelisms.ep import apply_ep
    from weft.parallelisms.fsdp import FSDPOptions, apply_fsdp
    from weft.parallelisms.materialize import materialize

    mesh = init_device_mesh("cpu", (RANKS,))
    with torch.device("meta"):
        model = Transformer(model_args_from_hf_folder(folder))
    if layout == "ep":
        apply_ep(model, mesh)
    else:
        apply_fsdp(model, mesh, FSDPOptions(param_dtype=torch.float32))
    materialize(model, "cpu", seed=1)  # the rotary table; every parameter is then overwritten by the load

    read: dict[str, set[int]] = {}
    opened = load.open_safetensors

    @contextlib.contextmanager
    def recording(path):
        with opened(path) as f:
            class Spy:
                def get_tensor(self, name):
                    if ".experts." in name:
                        prefix, rest = name.split(".experts.")
                        expert, projection = rest.split(".", 1)
                        read.setdefault(f"{prefix}.{projection}", set()).add(int(expert))
                    return f.get_tensor(name)
            yield Spy()

    load.open_safetensors = recording
    try:
        load_hf_into_model(model, folder)
    finally:
        load.open_safetensors = opened
    want = load_file(reference)
    differ = [name for name, p in model.named_parameters()
              if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), want[name])]
    save_hf_model(model, out)
    return differ, read


@pytest.mark.parametrize("layout", ["ep", "fsdp"])
def test_each_rank_reads_only_its_experts_and_the_export_splits_them_back(tmp_path, layout):
    folder = tmp_path / "hf"
    tiny_qwen3_hf_folder(folder, moe=True)
    single = Transformer(model_args_from_hf_folder(folder))
    load_hf_into_model(single, folder)
    save_file({name: p.detach().contiguous() for name, p in single.named_parameters()}, tmp_path / "reference.safetensors")
    results = run_distributed(load_sharded, RANKS, layout, str(folder), str(tmp_path / "reference.safetensors"),
                              str(tmp_path / "export"))
    moe_projections = 3 * sum(block.moe for block in single.layers.values())
    for rank, (differ, read) in enumerate(results):
        assert differ == []
        assert len(read) == moe_projections
        own = set(range(rank * N_EXPERTS // RANKS, (rank + 1) * N_EXPERTS // RANKS))
        assert all(experts == own for experts in read.values()), f"rank {rank} read {read}"
    source, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)
