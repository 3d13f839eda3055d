"""recipe/build.py: QLoRA's start-up streamed one unit at a time (`stream_qlora_base`).

The reference is the whole-model start it replaces: materialise everything, load the base,
quantize (`materialize`, `load_initial_weights`, `quantize_lora_base`). The streamed start must
give the same weights bit for bit from a seeded base, a DCP base and a Hugging Face base, and
hold less at its peak: the final model plus one unit in the compute dtype, not the whole base."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization import to_nf4

from weft import train
from weft.components.config import parse_args
from weft.components.hf import export_to_hf
from weft.components.memory import measured_peak_bytes, qlora_startup_bytes
from weft.models.llama import Transformer
from weft.parallelisms.lora import NF4_BLOCK, NF4_SCALER_BLOCK, lora_modules, quantize_lora_base
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallelize import parallelize
from weft.recipe.build import build_model, load_lora_base, stream_qlora_base
from weft.recipe.plan import RunPlan


def qlora_plan(initial_load_path: str = "") -> RunPlan:
    cfg = parse_args(["--job.config_file", "debug_lora", "--lora.quantize_base", "nf4",
                      f"--checkpoint.initial_load_path={initial_load_path}"])
    return RunPlan.from_config(cfg, 1, device_type="cpu", check_environment=False)


def whole_model_start(plan: RunPlan) -> torch.nn.Module:
    """The start before streaming: the whole model materialised and loaded, then quantized."""
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    return parallelize(model, None, plan.options, before_data_parallel=lambda m: load_lora_base(
        plan, materialize(m, "cpu", seed=plan.cfg.training.seed)))


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values; an NF4 weight as its packed codes, block scales and factor."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "quantized_data"):
            for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
                out[f"{name}:{part}"] = getattr(p, part)
        else:
            out[name] = p.detach()
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """A seed checkpoint of the debug model (DCP) and its Hugging Face export."""
    root = tmp_path_factory.mktemp("bases")
    train.train(parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(root / "run"),
                            "--checkpoint.create_seed_checkpoint", "--training.seed", "7"]))
    dcp = root / "run" / "checkpoint" / "step-0"
    export_to_hf(dcp, root / "hf", flavor="debugmodel")
    return {"seeded": "", "dcp": str(dcp), "hf": str(root / "hf")}


@pytest.mark.parametrize("source", ["seeded", "dcp", "hf"])
def test_streamed_start_equals_the_whole_model_start(bases, source):
    plan = qlora_plan(bases[source])
    streamed, whole = values(build_model(plan, None, torch.device("cpu"))), values(whole_model_start(plan))
    assert streamed.keys() == whole.keys()
    assert any(":quantized_data" in name for name in streamed)
    for name, value in whole.items():
        assert torch.equal(streamed[name], value), name
    if source != "seeded":  # the base really was read (its seed differs from the run's)
        assert not torch.equal(streamed["tok_embeddings.weight"], values(build_model(qlora_plan(), None, "cpu"))["tok_embeddings.weight"])


def test_streamed_start_holds_one_unit_in_the_compute_dtype_not_the_whole_base():
    """Measured by torch's CPU profiler: the streamed start's peak is what the quantized model
    finally holds, plus one unit (a block, or the embedding) in fp32, plus the work of quantizing
    one weight (torchao's, measured alone: on the debug model it outweighs a block); the
    whole-model start holds the whole fp32 base, all but about one unit of it more."""
    plan = qlora_plan()
    built = {}
    peak = measured_peak_bytes(lambda: built.setdefault("model", stream_qlora_base(plan, lora_meta(plan), None, "cpu")))
    model = built["model"]
    held = sum(nbytes(p) for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    unit = max(sum(p.numel() * 4 for p in part.parameters()) for part in [model.tok_embeddings, *model.layers.values()])
    largest = max((m for _, m in lora_modules(lora_meta(plan))), key=lambda m: m.weight.numel())
    weight = torch.randn(largest.weight.shape)
    quantizing = measured_peak_bytes(lambda: to_nf4(weight, NF4_BLOCK, NF4_SCALER_BLOCK))
    assert quantizing < peak <= 1.05 * (held + unit + quantizing)
    estimate = qlora_startup_bytes(lora_meta(plan), plan.model_args, torch.float32)  # the dry run's line
    assert peak <= estimate <= 1.25 * peak
    whole_base = sum(p.numel() * 4 for p in lora_meta(plan).parameters())
    whole_peak = measured_peak_bytes(lambda: quantize_lora_base(materialize(lora_meta(plan), "cpu")))
    assert whole_peak >= whole_base
    assert whole_peak - peak >= 0.8 * (whole_base - held - unit)  # the rest of the base never held unquantized


def lora_meta(plan: RunPlan) -> Transformer:
    """The debug model with QLoRA's adapters, on the meta device (parallelize in one process)."""
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    return parallelize(model, None, plan.options)


def nbytes(p: torch.Tensor) -> int:
    """Bytes a parameter holds; an NF4 weight: its codes, block scales and factors."""
    if hasattr(p, "quantized_data"):
        return sum(getattr(p, part).nbytes for part in ("quantized_data", "quantized_scalers", "quantization_factor"))
    return p.nbytes
