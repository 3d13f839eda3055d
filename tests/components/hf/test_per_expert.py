"""Per-expert Hugging Face tensors (Qwen3-MoE's `mlp.experts.{j}.gate_proj.weight`) in a sharded
model: under expert parallelism or FSDP each rank reads only the experts it holds, the sharded
model equals the one loaded in one process, and its export writes transformers' own tensors back.
In the same processes, gpt-oss's MXFP4 experts (one tensor of all experts): each rank reads and
dequantizes only its experts' rows, and equals the one-process load."""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from weft.components.hf import load_hf_into_model, model_args_from_hf_folder, save_hf_model
from weft.models.gpt_oss import Transformer as GptOss
from weft.models.qwen3 import Transformer

from tests.support.dist_utils import run_distributed
from tests.support.hf_folders import tiny_gpt_oss_hf_folder, tiny_qwen3_hf_folder

N_EXPERTS, RANKS = 8, 2


def _mxfp4_folder(tmp_path):
    """The tiny gpt-oss folder with its experts in MXFP4 (random codes, scales near 1)."""
    import json

    folder, packed = tmp_path / "gpt_oss", tmp_path / "gpt_oss_mxfp4"
    tiny_gpt_oss_hf_folder(folder)
    packed.mkdir()
    tensors, g = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(2)
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        experts, fan_in, fan_out = tensors.pop(key).shape
        tensors[f"{key}_blocks"] = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), generator=g, dtype=torch.uint8)
        tensors[f"{key}_scales"] = torch.randint(120, 130, (experts, fan_out, fan_in // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, packed / "model.safetensors")
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": {"quant_method": "mxfp4"}}
    (packed / "config.json").write_text(json.dumps(config))
    return packed


def _sharded(family: type, layout: str, folder: str):
    """`family`'s model of the folder on the meta device, spread by apply_ep or apply_fsdp, materialized."""
    from weft.parallelisms.ep import apply_ep
    from weft.parallelisms.fsdp import FSDPOptions, apply_fsdp
    from weft.parallelisms.materialize import materialize

    mesh = init_device_mesh("cpu", (RANKS,))
    with torch.device("meta"):
        model = family(model_args_from_hf_folder(folder))
    if layout == "ep":
        apply_ep(model, mesh)
    else:
        apply_fsdp(model, mesh, FSDPOptions(param_dtype=torch.float32))
    materialize(model, "cpu", seed=1)  # the rotary table; every parameter is then overwritten by the load
    return model


def _differ(model, reference: str) -> list[str]:
    want = load_file(reference)
    return [name for name, p in model.named_parameters()
            if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), want[name])]


def load_sharded(layout: str, folder: str, reference: str, out: str, mxfp4: str, mxfp4_reference: str):
    """Worker: meta → apply_ep or apply_fsdp → to_empty → load_hf_into_model → save_hf_model;
    returns (parameters whose full tensor differs from the one-process load, the expert indices
    of each expert projection this rank read from disk), and the same two for the gpt-oss MXFP4
    folder `mxfp4` (the experts' rows each blocks and scales tensor was read for)."""
    import weft.components.hf.load as load
    model = _sharded(Transformer, layout, folder)
    read: dict[str, set[int]] = {}
    opened = load.open_safetensors

    @contextlib.contextmanager
    def recording(path):
        with opened(path) as f:
            class Spy:
                def get_tensor(self, name):
                    if ".experts." in name and name.split(".experts.")[1][0].isdigit():  # one expert's tensor
                        prefix, rest = name.split(".experts.")
                        expert, projection = rest.split(".", 1)
                        read.setdefault(f"{prefix}.{projection}", set()).add(int(expert))
                    return f.get_tensor(name)

                def get_slice(self, name):
                    whole = f.get_slice(name)

                    class Rows:
                        def __getitem__(self, rows):
                            read.setdefault(name, set()).update(range(rows.start, rows.stop))
                            return whole[rows]
                    return Rows()
            yield Spy()

    load.open_safetensors = recording
    try:
        load_hf_into_model(model, folder)
        differ = _differ(model, reference)
        save_hf_model(model, out)
        experts, read = read, {}
        packed = _sharded(GptOss, layout, mxfp4)
        load_hf_into_model(packed, mxfp4)
    finally:
        load.open_safetensors = opened
    return differ, experts, _differ(packed, mxfp4_reference), read


@pytest.mark.parametrize("layout", ["ep", "fsdp"])
def test_each_rank_reads_only_its_experts_and_the_export_splits_them_back(tmp_path, layout):
    folder = tmp_path / "hf"
    tiny_qwen3_hf_folder(folder, moe=True)
    single = Transformer(model_args_from_hf_folder(folder))
    load_hf_into_model(single, folder)
    save_file({name: p.detach().contiguous() for name, p in single.named_parameters()}, tmp_path / "reference.safetensors")
    mxfp4 = _mxfp4_folder(tmp_path)
    packed = GptOss(model_args_from_hf_folder(mxfp4))
    load_hf_into_model(packed, mxfp4)
    save_file({name: p.detach().contiguous() for name, p in packed.named_parameters()}, tmp_path / "mxfp4.safetensors")
    results = run_distributed(load_sharded, RANKS, layout, str(folder), str(tmp_path / "reference.safetensors"),
                              str(tmp_path / "export"), str(mxfp4), str(tmp_path / "mxfp4.safetensors"))
    moe_projections = 3 * sum(block.moe for block in single.layers.values())
    for rank, (differ, read, mxfp4_differ, mxfp4_read) in enumerate(results):
        assert differ == []
        assert len(read) == moe_projections
        own = set(range(rank * N_EXPERTS // RANKS, (rank + 1) * N_EXPERTS // RANKS))
        assert all(experts == own for experts in read.values()), f"rank {rank} read {read}"
        assert mxfp4_differ == []
        assert len(mxfp4_read) == 8  # blocks and scales of gate_up_proj and down_proj, 2 layers
        own = set(range(rank * 4 // RANKS, (rank + 1) * 4 // RANKS))  # 4 experts
        assert all(experts == own for experts in mxfp4_read.values()), f"rank {rank} read {mxfp4_read}"
    source, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[key], source[key]) for key in source)
