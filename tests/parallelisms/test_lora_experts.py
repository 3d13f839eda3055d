"""LoRA on the routed experts (parallelisms/lora.py, models/common/moe.py): a rank-r adapter per expert in
the layout of the expert-adapter spec (`<experts>.lora_A.<w>` [E, r, in], `.lora_B.<w>` [E, out, r]).

References: the same MoE with each expert's weight merged by hand, w + scaling · B @ A (outputs,
routing, and the adapters' gradients by autograd through the merge), over a plain and an NF4
base (torchao's own dequantized experts); PEFT's kaiming-uniform bound for A; one process for
ep 2 and fsdp 2 (losses, routing biases, adapters), and eager for AC + compile."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from weft.components.config import ConfigError, parse_args
from weft.layers.nf4_experts import NF4Experts
from weft.models.common.moe import MoE
from weft.models.llama import LLAMA_FLAVORS
from weft.models.llama import Transformer as Llama
from weft.models.llama4 import LLAMA4_FLAVORS, Transformer
from weft.parallelisms.common import TransformError
from weft.parallelisms.lora import (
    LoRAOptions,
    apply_lora,
    expert_lora_modules,
    lora_modules,
    merge_adapters,
    quantize_lora_base,
)
from weft.parallelisms.materialize import materialize
from weft.recipe.plan import RunPlan

from tests.support.dist_utils import run_distributed
from tests.support.train_runs import run_args

WEIGHTS = ("w1", "w2", "w3")
# dim and hidden 128: each expert's 16,384 values hold whole NF4 scale groups
DIM, HIDDEN, EXPERTS, TOP_K, RANK, ALPHA = 128, 128, 4, 2, 4, 8.0


def adapted_moe(nf4: bool, targets=("experts",)) -> tuple[MoE, MoE]:
    """(the base MoE, a copy with expert adapters, B drawn so that they count), fp32."""
    torch.manual_seed(0)
    base = MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden_dim=64)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.1)
    base.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # the routing's bias counts too
    model = apply_lora(copy.deepcopy(base), LoRAOptions(rank=RANK, alpha=ALPHA, target_modules=list(targets),
                                                          quantize_base="nf4" if nf4 else None))
    if nf4:
        quantize_lora_base(model)
    with torch.no_grad():
        for p in model.experts.lora_B.parameters():
            p.normal_(std=0.1)
    return base, model


def merged_by_hand(base: MoE, model: MoE) -> tuple[MoE, dict[str, torch.Tensor]]:
    """The base MoE (NF4: its experts as torchao dequantizes them) and, per projection, its merged
    weight w + scaling · B @ A as a function of leaf copies of A and B (for autograd)."""
    experts, leaves = model.experts, {}
    merged = {}
    for w in WEIGHTS:
        frozen = getattr(experts, w)
        frozen = frozen.dequantize(torch.float32) if isinstance(frozen, NF4Experts) else frozen.detach()
        if hasattr(experts.lora_A, w):
            a = leaves[f"A.{w}"] = getattr(experts.lora_A, w).detach().clone().requires_grad_()
            b = leaves[f"B.{w}"] = getattr(experts.lora_B, w).detach().clone().requires_grad_()
            frozen = frozen + experts.lora_scaling * torch.bmm(b, a)
        merged[f"experts.{w}"] = frozen
    return merged, leaves


@pytest.mark.parametrize("nf4", [False, True], ids=["plain", "nf4"])
@pytest.mark.parametrize("targets", [("experts",), ("experts.w1", "experts.w2")], ids=["all", "some"])
def test_adapted_experts_equal_their_hand_merged_weights_with_the_same_routing_and_gradients(nf4, targets):
    base, model = adapted_moe(nf4, targets)
    x = torch.randn(3, 10, DIM, generator=torch.Generator().manual_seed(1))
    merged, leaves = merged_by_hand(base, model)
    reference = functional_call(base, merged, (x,))
    out = model(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    assert torch.equal(model.tokens_per_expert, base.tokens_per_expert)  # routed alike
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    (reference * weights).sum().backward()
    got = {f"{f[-1]}.{w}": p.grad for f in ("lora_A", "lora_B")
           for w, p in getattr(model.experts, f).named_parameters()}
    assert got.keys() == leaves.keys() and len(got) == (6 if targets == ("experts",) else 4)
    for name, leaf in leaves.items():
        torch.testing.assert_close(got[name], leaf.grad, rtol=1e-4, atol=1e-5)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


@pytest.mark.parametrize("nf4", [False, True], ids=["plain", "nf4"])
def test_merge_adapters_holds_the_hand_merged_expert_weights(nf4):
    """merge_adapters: each adapted expert weight becomes w + scaling · B @ A (NF4: of torchao's
    dequantized experts), the adapters go, and the MoE computes as the adapted one."""
    base, model = adapted_moe(nf4, ("experts.w1", "experts.w2"))
    x = torch.randn(3, 10, DIM, generator=torch.Generator().manual_seed(1))
    merged, _ = merged_by_hand(base, model)
    with torch.no_grad():
        adapted = model(x)
        merge_adapters(model)
        for w in WEIGHTS:
            torch.testing.assert_close(getattr(model.experts, w), merged[f"experts.{w}"], rtol=0, atol=1e-6)
        torch.testing.assert_close(model(x), adapted, rtol=0, atol=1e-5)
    assert not expert_lora_modules(model) and not hasattr(model.experts, "lora_scaling")


def test_layout_init_and_glob_targets():
    """The spec's names and shapes; A per expert within PEFT's kaiming bound 1/sqrt(in), B zero;
    the same values from the meta-device path (materialize) as on real weights."""
    args = replace(LLAMA4_FLAVORS["debugmodel_moe"], n_layers=2, vocab_size=128)
    real = Transformer(args)
    real.init_weights(seed=0)
    apply_lora(real, LoRAOptions(rank=RANK, alpha=ALPHA,
                               target_modules=["wq", "layers.*.feed_forward.experts.w2", "experts.w1"]))
    shapes = {n: tuple(p.shape) for n, p in real.named_parameters() if ".experts.lora_" in n}
    e, h, d = args.n_experts, args.expert_hidden_dim, args.dim
    assert shapes == {"layers.1.feed_forward.experts.lora_A.w1": (e, RANK, d),
                      "layers.1.feed_forward.experts.lora_B.w1": (e, h, RANK),
                      "layers.1.feed_forward.experts.lora_A.w2": (e, RANK, h),
                      "layers.1.feed_forward.experts.lora_B.w2": (e, d, RANK)}
    experts = real.layers["1"].feed_forward.experts
    assert (experts.lora_rank, experts.lora_alpha, experts.lora_scaling) == (RANK, ALPHA, ALPHA / RANK)
    for w, a in experts.lora_A.named_parameters():
        bound = 1 / math.sqrt(a.shape[2])  # kaiming-uniform, a = sqrt(5), of one expert's [rank, in]
        assert a.abs().max() <= bound and a.abs().amax((1, 2)).min() > 0.8 * bound
        assert not torch.equal(a[0], a[1])  # each expert its own draw
    assert all(torch.count_nonzero(b) == 0 for b in experts.lora_B.parameters())
    with torch.device("meta"):
        meta = Transformer(args)
    apply_lora(meta, LoRAOptions(rank=RANK, alpha=ALPHA,
                               target_modules=["wq", "layers.*.feed_forward.experts.w2", "experts.w1"]))
    materialize(meta, "cpu", seed=0)
    theirs = dict(meta.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in real.named_parameters() if ".lora_" in n)


def test_base_dtype_keeps_frozen_experts_bf16_and_adapters_fp32():
    base, _ = adapted_moe(False)
    model = apply_lora(base, LoRAOptions(rank=RANK, alpha=ALPHA, target_modules=["experts"], base_dtype=torch.bfloat16))
    assert {getattr(model.experts, w).dtype for w in WEIGHTS} == {torch.bfloat16}
    adapters = [p for _, m in expert_lora_modules(model) for p in [*m.lora_A.parameters(), *m.lora_B.parameters()]]
    assert len(adapters) == 6 and {p.dtype for p in adapters} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(5, DIM))
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters)


@pytest.mark.parametrize("moe, targets, message", [
    (True, ["wq", "experts.w4"], "target_modules names 'experts.w4': routed experts take adapters on w1, w2, w3"),
    (False, ["wq", "experts"], "target_modules names 'experts', and Transformer has no routed experts"),
])
def test_bad_expert_targets_are_one_line(moe, targets, message):
    with torch.device("meta"):
        model = (Transformer(replace(LLAMA4_FLAVORS["debugmodel_moe"], n_layers=2)) if moe else
                 Llama(replace(LLAMA_FLAVORS["debugmodel"], n_layers=1)))
    with pytest.raises(TransformError, match=message):
        apply_lora(model, LoRAOptions(rank=RANK, alpha=ALPHA, target_modules=targets))


@pytest.mark.parametrize("config, targets, message", [
    ("debug_moe", "wq,experts.w4", "lora.target_modules = ['wq', 'experts.w4']: apply_lora: target_modules names "
     "'experts.w4': routed experts take adapters on w1, w2, w3"),
    ("debug_model", "wq,experts", "lora.target_modules = ['wq', 'experts']: apply_lora: target_modules names "
     "'experts', and Transformer has no routed experts"),
])
def test_bad_expert_targets_are_refused_by_the_plan(tmp_path, config, targets, message):
    cfg = parse_args(run_args(tmp_path / "run", "--lora.enable", "--lora.target_modules", targets, config=config))
    with pytest.raises(ConfigError) as error:
        RunPlan.from_config(cfg, 1, check_environment=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Layouts: ep 2 and fsdp 2 against one process; AC + compile against eager
# ---------------------------------------------------------------------------------------------

ARGS = replace(LLAMA4_FLAVORS["debugmodel_moe"], attention_chunk_size=8, n_layers=2)
TARGETS = ["wq", "wv", "experts"]


def layouts_and_one_process() -> dict[str, tuple]:
    """Worker (2 ranks): LoRA on wq, wv and the experts of the debug MoE (2 layers) trained 10 steps
    by ep 2 (borrowed from fsdp 2) and by fsdp 2, each on its half of the batches, by tp 2 (the
    experts and their adapters split by hidden dimension) and one process on the whole ones; and QLoRA (NF4 base and experts) so by ep 2 and one process. For
    each: (losses, expert biases, adapters gathered whole)."""
    from weft.components.training.moe_balance import moe_layers
    from weft.parallelisms.fsdp import FSDPOptions
    from weft.parallelisms.parallel_dims import ParallelDims
    from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

    from tests.support.ep_training import BATCH, train

    rank, world = dist.get_rank(), dist.get_world_size()
    lora = LoRAOptions(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    results = {}
    for name, ep, nf4 in (("one process", 1, False), ("fsdp2", 1, False), ("ep2", 2, False), ("tp2", 1, False),
                          ("one process nf4", 1, True), ("ep2 nf4", 2, True)):
        options = ParallelizeOptions(lora=replace(lora, quantize_base="nf4" if nf4 else None),
                                     fsdp=FSDPOptions(param_dtype=torch.float32))
        with torch.device("meta"):
            model = Transformer(ARGS)
        if name.startswith("one process"):
            apply_lora(model, options.lora)
            materialize(model, "cpu", seed=0)
            quantize_lora_base(model)
        else:
            tp = world if name == "tp2" else 1  # the experts split by hidden dimension, adapters with them
            meshes = ParallelDims.resolve(world_size=world, dp_shard=world // tp, tp=tp, ep=ep).build_mesh("cpu")
            parallelize(model, meshes, options, before_data_parallel=lambda m: materialize(m, "cpu", seed=0))
        share = BATCH // world
        whole = name.startswith("one process") or name == "tp2"  # tp's ranks read the same samples
        rows = slice(None) if whole else slice(rank * share, (rank + 1) * share)
        losses = train(model, rows, 1 if whole else world, fsdp=True)
        adapters = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy()  # by value, not shared
                    for n, p in model.named_parameters() if ".experts.lora_" in n}
        results[name] = (losses, [layer.expert_bias.tolist() for _, layer in moe_layers(model)], adapters)
        if name == "tp2":
            results["tp2 placements"] = {n.split("experts.")[1]: str(p.placements[-1]) for n, p in model.named_parameters()
                                         if ".experts.lora_" in n}
    return results


@pytest.mark.slow
def test_ep2_fsdp2_and_tp2_train_expert_adapters_as_one_process():
    """Plain base: fp32 reduction order only (1e-5); NF4: every layout quantizes each expert alone
    from the same seeded weights, so the base is the same bit for bit, and the same tolerance holds."""
    results = run_distributed(layouts_and_one_process, 2)[0]
    assert results.pop("tp2 placements") == {  # B of w1, w3 by rows, A of w2 by columns, the rest whole
        "lora_A.w1": "R", "lora_A.w2": "S(2)", "lora_A.w3": "R", "lora_B.w1": "S(1)", "lora_B.w2": "R", "lora_B.w3": "S(1)"}
    for base in ("", " nf4"):
        losses, biases, adapters = results.pop(f"one process{base}")
        assert len(losses) == 10 and any(b != 0 for layer in biases for b in layer)  # the routing moves
        assert len(adapters) == 6 and all(abs(a).sum() > 0 for n, a in adapters.items() if "lora_B" in n)  # B moved
        for name in [n for n in results if n.endswith(base) and (base or "nf4" not in n)]:
            their_losses, their_biases, theirs = results[name]
            assert max(abs(a - b) for a, b in zip(their_losses, losses)) < 1e-5, name
            assert their_biases == biases, name  # the same routing all along
            assert max(abs(theirs[n] - adapters[n]).max() for n in adapters) < 1e-4, name
    assert results["ep2 nf4"][0] != results["ep2"][0]  # NF4 changed the base: not the plain run twice


@pytest.mark.slow
def test_full_ac_and_compiled_blocks_train_expert_adapters_as_eager():
    """Fullgraph blocks (aot_eager: the graphs inductor would get, without its C++ build on CPU),
    the experts' adapters through the masked multiply (fp32 under compile), recomputed by AC."""
    from weft.parallelisms.ac import ACOptions
    from weft.parallelisms.compile import CompileOptions
    from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

    from tests.support.ep_training import train

    lora = LoRAOptions(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    losses = {}
    for name, options in (("eager", ParallelizeOptions(lora=lora)),
                          ("ac+compile", ParallelizeOptions(lora=lora, ac=ACOptions(mode="full"),
                                                            compile=CompileOptions("aot_eager")))):
        with torch.device("meta"):
            model = Transformer(ARGS)
        parallelize(model, None, options)
        materialize(model, "cpu", seed=0)
        losses[name] = train(model, slice(None), 1, steps=3)
    assert losses["ac+compile"] == pytest.approx(losses["eager"], rel=1e-5)
    assert len(lora_modules(model)) == 4 and len(expert_lora_modules(model)) == 1  # wq, wv of 2 layers; 1 MoE
