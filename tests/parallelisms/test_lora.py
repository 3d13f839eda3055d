"""apply_lora and quantize_lora_base (parallelisms/lora.py).

References: PEFT's get_peft_model trained side by side (same adapter values, data and AdamW);
the model without adapters (step 0 is the base exactly); torchao's own dequantized NF4 weights
in a plain model (QLoRA); and the single-process run of the same model for every layout."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.components.distributed.processes import set_determinism
from weft.components.hf.writer import save_peft_adapter
from weft.models.llama import ModelArgs, Transformer
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.cp import shard_sequence
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.lora import (
    LoRAOptions,
    adapters_off,
    apply_lora,
    lora_modules,
    merge_adapters,
    quantize_lora_base,
)
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

from tests.support.dist_utils import run_distributed

STEPS, VOCAB, SEED = 10, 128, 0
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=64)
# Every targeted weight holds whole NF4 scale groups (64 x nf4_scaler_block values), two per FSDP shard at least.
NF4_ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=256, max_seq_len=64)
LORA = LoRAOptions(rank=4, alpha=8.0)
NF4 = replace(LORA, quantize_base="nf4")
FP32 = FSDPOptions(param_dtype=torch.float32)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(1))


def train_hf(model: nn.Module) -> list[float]:
    tokens = batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(STEPS):
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_rslora", [False, True])
def test_training_matches_peft(use_rslora):
    """weft's adapters on a transformers Llama train exactly as PEFT's do (A copied from PEFT)."""
    from peft import LoraConfig, get_peft_model

    base = hf_llama()
    ours = apply_lora(copy.deepcopy(base), LoRAOptions(rank=4, alpha=8.0, use_rslora=use_rslora))
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                           use_rslora=use_rslora))
    modules = lora_modules(ours)
    assert len(modules) == 14  # 7 linears a block, the lm_head left whole, as PEFT's all-linear
    for name, module in modules:
        theirs = peft.get_submodule(f"base_model.model.{name}")
        assert module.scaling == theirs.scaling["default"]
        assert torch.equal(module.lora_B.weight, theirs.lora_B["default"].weight)  # both zero
        bound = 1 / math.sqrt(module.in_features)  # PEFT's kaiming-uniform(a=sqrt(5)) range
        assert module.lora_A.weight.abs().max() <= bound
        with torch.no_grad():
            module.lora_A.weight.copy_(theirs.lora_A["default"].weight)
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == sorted(
        n.removeprefix("base_model.model.").replace(".default", "") for n, p in peft.named_parameters() if p.requires_grad)
    weft_losses, peft_losses = train_hf(ours), train_hf(peft)
    assert weft_losses[-1] < weft_losses[0] - 0.1, "the adapters must learn"
    assert weft_losses == pytest.approx(peft_losses, rel=1e-5)


def build(args: ModelArgs = TINY) -> nn.Module:
    with torch.device("meta"):
        return Transformer(args)


def test_adapters_off_computes_as_peft_disable_adapter():
    """adapters_off: trained adapters (B nonzero) leave the outputs exactly the base's, as PEFT's
    disable_adapter does, and come back after the block, even one that raised."""
    from peft import LoraConfig, get_peft_model

    base = hf_llama()
    ours = apply_lora(copy.deepcopy(base), LoRAOptions(rank=4, alpha=8.0))
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, module in lora_modules(ours):
            theirs = peft.get_submodule(f"base_model.model.{name}")
            for factor in ("lora_A", "lora_B"):
                getattr(module, factor).weight.normal_(generator=generator)
                getattr(theirs, factor)["default"].weight.copy_(getattr(module, factor).weight)
        tokens = batch()
        plain, adapted = base(tokens).logits, ours(tokens).logits
        assert torch.allclose(adapted, peft(tokens).logits, atol=1e-5) and not torch.allclose(adapted, plain)
        with adapters_off(ours), peft.disable_adapter():
            off = ours(tokens).logits
            assert torch.equal(off, plain) and torch.allclose(off, peft(tokens).logits, atol=1e-6)
        with pytest.raises(ZeroDivisionError), adapters_off(ours):
            1 / 0
        assert torch.equal(ours(tokens).logits, adapted)


def test_merge_adapters_holds_peft_merge_and_unload_s_weights_in_plain_linears():
    """merge_adapters: trained adapters (B nonzero) added into their weights as PEFT's
    merge_and_unload adds them, every LoRALinear a plain nn.Linear, the logits the adapted model's."""
    from peft import LoraConfig, get_peft_model

    base = hf_llama()
    ours = apply_lora(copy.deepcopy(base), LoRAOptions(rank=4, alpha=8.0))
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, module in lora_modules(ours):
            theirs = peft.get_submodule(f"base_model.model.{name}")
            for factor in ("lora_A", "lora_B"):
                getattr(module, factor).weight.normal_(generator=generator)
                getattr(theirs, factor)["default"].weight.copy_(getattr(module, factor).weight)
        adapted = ours(batch()).logits
        merged = merge_adapters(ours)
        theirs = peft.merge_and_unload()
    assert not lora_modules(merged) and all(type(m) is nn.Linear for n, m in merged.named_modules() if n.endswith("proj"))
    assert merged.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(merged(batch()).logits, adapted, rtol=0, atol=1e-5)


def test_weft_llama_starts_as_its_base():
    """After materialize, B = 0: logits equal the model without adapters; only adapters train;
    A is the same seeded draw whoever builds it."""
    tokens = batch()
    base = materialize(build(), "cpu", seed=SEED)
    lora = materialize(parallelize(build(), None, ParallelizeOptions(lora=LORA)), "cpu", seed=SEED)
    again = materialize(parallelize(build(), None, ParallelizeOptions(lora=LORA)), "cpu", seed=SEED)
    assert torch.equal(lora(tokens), base(tokens))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.{m}.lora_{ab}.weight" for i in range(2) for ab in "AB"
                         for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    for (_, a), (_, b) in zip(lora_modules(lora), lora_modules(again)):
        assert torch.equal(a.lora_A.weight, b.lora_A.weight) and a.lora_A.weight.abs().sum() > 0
    assert all(torch.equal(p, base.get_parameter(n)) for n, p in lora.named_parameters() if "lora_" not in n)


def test_target_modules_by_last_name_and_glob():
    model = apply_lora(build(), LoRAOptions(rank=2, alpha=2.0, target_modules=["wq", "layers.1.feed_forward.w*"]))
    assert [n for n, _ in lora_modules(model)] == [
        "layers.0.attention.wq", "layers.1.attention.wq", "layers.1.feed_forward.w1",
        "layers.1.feed_forward.w2", "layers.1.feed_forward.w3"]
    assert isinstance(model.layers["1"].attention.wq, nn.Linear)  # still a Linear, same weight name


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0, alpha=8.0), "rank must be a positive integer, got 0"),
    (dict(rank=4, alpha=0.0), "alpha must be > 0, got 0.0"),
    (dict(rank=4, alpha=8.0, dropout=1.0), "dropout must be in [0, 1), got 1.0"),
    (dict(rank=4, alpha=8.0, target_modules=["q_proj"]),
     "target_modules ['q_proj'] matches no nn.Linear of Transformer; its linears are named output, w1, w2, w3, wk, wo, wq, wv"),
    (dict(rank=4, alpha=8.0, quantize_base="nf4"),
     "cannot quantize layers.0.attention.wq (64, 64) to NF4"),
    (dict(rank=4, alpha=8.0, quantize_base="int4"), "quantize_base must be None or one of nf4, got 'int4'"),
])
def test_bad_arguments_are_one_line(kwargs, message):
    model = build()
    with pytest.raises(TransformError) as error:
        apply_lora(model, LoRAOptions(**kwargs))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())  # untouched


def test_nf4_checks_fsdp_shards_and_meta():
    model = apply_lora(build(NF4_ARGS), LoRAOptions(rank=4, alpha=8.0, target_modules=["wq"], quantize_base="nf4"))
    with pytest.raises(TransformError, match="meta device; quantize real weights"):
        quantize_lora_base(model)
    materialize(model, "cpu", seed=SEED)
    with pytest.raises(TransformError, match=r"cannot shard NF4 layers.0.attention.wq \(256, 256\) over 16 FSDP ranks"):
        quantize_lora_base(model, shards=16)


def test_qlora_computes_with_torchaos_dequantized_base():
    """An NF4 base gives the logits of a plain model holding torchao's dequantized weights."""
    from torchao.quantization import NF4Tensor

    tokens = batch()
    qlora = parallelize(build(NF4_ARGS), None, ParallelizeOptions(lora=NF4),
                        before_data_parallel=lambda m: materialize(m, "cpu", seed=SEED))
    reference = materialize(parallelize(build(NF4_ARGS), None, ParallelizeOptions(lora=LORA)), "cpu", seed=SEED)
    with torch.no_grad():
        for name, module in lora_modules(qlora):
            assert isinstance(module.weight, NF4Tensor)
            module.lora_B.weight.normal_()  # adapters that contribute
            target = reference.get_submodule(name)
            target.weight.copy_(module.weight.get_original_weight())
            target.lora_B.weight.copy_(module.lora_B.weight)
            target.lora_A.weight.copy_(module.lora_A.weight)
    assert not torch.equal(reference.layers["0"].attention.wq.weight, materialize(build(NF4_ARGS), "cpu").layers["0"].attention.wq.weight)
    torch.testing.assert_close(qlora(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Every layout equals one process
# ---------------------------------------------------------------------------------------------

# name -> (world size, dp_replicate, dp_shard, cp, tp, QLoRA, activation checkpointing, compile)
LAYOUTS = {
    "fsdp2": (2, 1, 2, 1, 1, False, "full", False),
    "tp2": (2, 1, 1, 1, 2, False, "none", False),
    "cp2": (2, 1, 1, 2, 1, False, "none", False),
    "qlora_fsdp2": (2, 1, 2, 1, 1, True, "none", False),
    # Compiled blocks (aot_eager: the graphs inductor would get, without its C++ build on CPU).
    "fsdp2_compile_ac": (2, 1, 2, 1, 1, False, "full", True),
    "qlora_fsdp2_compile": (2, 1, 2, 1, 1, True, "none", True),
    "fsdp2_tp2": (4, 1, 2, 1, 2, False, "none", False),
    "hsdp2x2": (4, 2, 2, 1, 1, False, "full", False),
}
EXPORTED = "fsdp2_tp2"


def train_weft(model: nn.Module, meshes=None) -> list[float]:
    """10 AdamW steps on one fixed batch; each rank its data-parallel share and (CP) sequence shard."""
    tokens_all = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    dims = meshes.dims if meshes else None
    share = tokens_all.chunk(dims.dp)[meshes.dp.get_local_rank()] if meshes else tokens_all
    losses = []
    for _ in range(STEPS):
        tokens, labels, positions = share[:, :-1], share[:, 1:], None
        if dims is not None and dims.cp > 1:
            (tokens, labels), positions = shard_sequence(meshes.cp, tokens, labels)
        loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if meshes is not None:
            dist.all_reduce(loss, group=meshes.dp_cp.get_group())
            loss /= dims.dp * dims.cp
        losses.append(loss.item())
    return losses


def build_lora(qlora: bool, meshes=None, ac_mode: str = "none", compile: bool = False) -> nn.Module:
    """meta -> parallelize (LoRA, and QLoRA's materialize + quantize before FSDP) -> materialize."""
    options = ParallelizeOptions(lora=LORA, ac=ACOptions(ac_mode), fsdp=FP32,
                                 compile=CompileOptions("aot_eager") if compile else None)
    if qlora:
        return parallelize(build(NF4_ARGS), meshes, replace(options, lora=NF4),
                           before_data_parallel=lambda m: materialize(m, "cpu", seed=SEED))
    model = parallelize(build(), meshes, options)
    return materialize(model, "cpu", seed=SEED)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The PEFT adapter folder the writer makes of `model` (every rank calls; rank 0's dict)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        save_peft_adapter(model, Path(folder) / "adapter")
        written = Path(folder) / "adapter" / "adapter_model.safetensors"
        return load_file(str(written)) if written.is_file() else {}


def train_layouts(names: list[str]) -> dict[str, list[float]]:
    losses = {}
    for name in names:
        world, replicate, shard, cp, tp, qlora, ac_mode, compile = LAYOUTS[name]
        dims = ParallelDims.resolve(dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, world_size=world)
        meshes = dims.build_mesh("cpu")
        model = build_lora(qlora, meshes, ac_mode, compile)
        if qlora:  # FSDP shards the NF4 tensors themselves
            from torchao.quantization import NF4Tensor

            assert all(isinstance(m.weight.to_local(), NF4Tensor) for _, m in lora_modules(model))
        losses[name] = train_weft(model, meshes)
        if name == EXPORTED:  # the export gathers split adapters (a collective on every rank)
            losses["exported"] = {k: v.tolist() for k, v in adapter_state(model).items()}
        dist.barrier()
    return losses


@pytest.fixture(scope="module")
def references() -> dict[bool, list[float]]:
    return {qlora: train_weft(build_lora(qlora)) for qlora in (False, True)}


@pytest.fixture(scope="module")
def reference_adapters() -> dict[str, torch.Tensor]:
    model = build_lora(False)
    train_weft(model)
    return adapter_state(model)


@pytest.fixture(scope="module")
def layout_losses() -> dict[str, list[float]]:
    losses = {}
    for world in sorted({w for w, *_ in LAYOUTS.values()}):
        names = [n for n, (w, *_) in LAYOUTS.items() if w == world]
        losses.update(run_distributed(train_layouts, world, names, timeout=600)[0])
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, references, layout_losses):
    reference = references[LAYOUTS[layout][5]]
    assert reference[-1] < reference[0] - 0.1, "the adapters must learn"
    assert layout_losses[layout] == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_adapters_exported_from_a_split_layout_equal_one_process(reference_adapters, layout_losses):
    exported = {k: torch.tensor(v) for k, v in layout_losses["exported"].items()}
    assert exported.keys() == reference_adapters.keys()
    # atol 1e-5: ten AdamW steps at lr 1e-2 amplify fp32 reduction-order noise in the few elements
    # whose gradients are near zero (up to 2.6e-6 seen from fsdp 2 x tp 2, run alone, the same at the
    # commit whose suite passed with 1e-6); a gather that misplaced or dropped a shard is off by ~1e-2.
    for key, value in reference_adapters.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-5)


def dropout_masks() -> dict[str, list[list[int]]]:
    """Worker (tp 2): the local dropout mask (1 = dropped) of a column-split and of a row-split
    linear's adapter input, in one forward with dropout 0.5."""
    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2)
    model = materialize(parallelize(build(), dims.build_mesh("cpu"), ParallelizeOptions(
        lora=replace(LORA, dropout=0.5), fsdp=FP32)), "cpu", seed=SEED)
    masks = {}

    def keep(name):
        def hook(module, inputs, output):
            x, y = inputs[0].to_local(), output.to_local()
            masks[name] = ((y == 0) & (x != 0)).int().flatten().tolist()
        return hook

    model.layers["0"].attention.wq.lora_dropout.register_forward_hook(keep("column-split wq"))
    model.layers["0"].attention.wo.lora_dropout.register_forward_hook(keep("row-split wo"))
    set_determinism(7, deterministic=False)  # as train.py seeds every rank
    model(torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)))
    return masks


@pytest.mark.slow
def test_dropout_under_tensor_parallelism_drops_one_mask_of_the_whole_input():
    """A column-split base reads the whole input on every tp rank, and every rank drops the same
    elements of it, so the output shards are one adapter's output (on GPUs DTensor's generator
    keeps replicated draws equal; on the CPU the ranks' own generators, seeded alike as train.py
    seeds them). A row-split base reads a slice of the input, and each rank drops elements of its own
    slice at the same rate (on the CPU, with equal generators, the slices repeat one pattern; on
    GPUs DTensor's generator draws them as slices of one mask)."""
    first, second = run_distributed(dropout_masks, 2)
    assert first["column-split wq"] == second["column-split wq"]
    for masks in (first, second):
        for mask in masks.values():
            assert 0.4 < sum(mask) / len(mask) < 0.6
