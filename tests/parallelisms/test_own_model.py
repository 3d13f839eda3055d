"""weft's transforms on models weft did not write: a transformers LlamaForCausalLM and a
nanoGPT-style model, each built on the meta device, parallelised by `parallelize` with
activation checkpointing and compile, materialised, and trained 10 steps (and a nanoGPT whose MLPs
are weft's MoE layer, under `apply_ep` alone). Every layout must
follow the single-device eager run of the same model from the same weights (fp32, CPU, gloo).

Tensor-parallel layouts (all with activation checkpointing here) compile only where torch can
(`torch_has_tp_compile_bug`); the last tests reproduce that torch bug (without the input copy
`parallelize` adds), so a torch release that fixes it turns the test red here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions, torch_has_tp_compile_bug
from weft.parallelisms.cp import shard_sequence
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize

from tests.support.dist_utils import run_distributed
from tests.support.own_models import SEQ_LEN, VOCAB, NanoGPT, hf_llama

STEPS, GLOBAL_BATCH, SEED = 10, 4, 0
# Dynamo and AOTAutograd trace each block whole (fullgraph) with AC, DTensors and collectives;
# inductor's kernel generation, which weft does not touch, would triple this test's time.
COMPILE_BACKEND = "aot_eager"

# name -> (model kind, world size, dp_shard, cp, tp)
LAYOUTS = {
    "hf_fsdp2": ("hf", 2, 2, 1, 1),
    "hf_tp2": ("hf", 2, 1, 1, 2),
    "hf_cp2": ("hf", 2, 1, 2, 1),
    "nanogpt_fsdp2": ("nanogpt", 2, 2, 1, 1),
    # hf under fsdp 2 x tp 2 (4 ranks): the README example's test trains it (tests/e2e/test_install.py)
}


# ---------------------------------------------------------------------------------------------
# The two models
# ---------------------------------------------------------------------------------------------


def build(kind: str) -> nn.Module:
    with torch.device("meta"):
        return hf_llama() if kind == "hf" else NanoGPT()


def logits_of(model: nn.Module, kind: str, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    if kind == "nanogpt":
        return model(tokens)
    return model(input_ids=tokens, position_ids=None if positions is None else positions[None], use_cache=False).logits


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def batches():
    """One fixed batch, seen every step: the loss falls fast, so a wrong gradient would show."""
    batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [batch] * STEPS


def train(model: nn.Module, kind: str, meshes=None) -> list[float]:
    """10 AdamW steps; each rank takes its data-parallel share and (under CP) its sequence shard.
    Returns the global mean loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dims = meshes.dims if meshes else None
    dp, dp_rank = (dims.dp, meshes.dp.get_local_rank()) if meshes else (1, 0)
    losses = []
    for batch in batches():
        batch = batch.chunk(dp)[dp_rank]
        tokens, labels, positions = batch[:, :-1], batch[:, 1:], None
        if dims is not None and dims.cp > 1:
            (tokens, labels), positions = shard_sequence(meshes.cp, tokens, labels)
        logits = logits_of(model, kind, tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if meshes is not None:  # every rank's loss is a mean over equally many tokens
            dist.all_reduce(loss, group=meshes.dp_cp.get_group())
            loss /= dims.dp * dims.cp
        losses.append(loss.item())
    return losses


def train_layouts(names: list[str]) -> dict[str, list[float]]:
    """Worker: each layout in turn, built meta → parallelize (AC + compile) → materialize → train."""
    losses = {}
    for name in names:
        kind, world_size, dp_shard, cp, tp = LAYOUTS[name]
        dims = ParallelDims.resolve(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size)
        meshes = dims.build_mesh("cpu")
        compile = not (tp > 1 and torch_has_tp_compile_bug())
        model = parallelize(build(kind), meshes, ParallelizeOptions(
            ac=ACOptions("full"), compile=CompileOptions(COMPILE_BACKEND) if compile else None,
            fsdp=FSDPOptions(param_dtype=torch.float32, reduce_dtype=torch.float32)))
        materialize(model, "cpu", seed=SEED)
        losses[name] = train(model, kind, meshes)
        torch._dynamo.reset()  # the next layout's blocks compile afresh
        dist.barrier()
    return losses


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    """Single device, eager, no activation checkpointing: the plain computation."""
    return {kind: train(materialize(build(kind), "cpu", seed=SEED), kind) for kind in ("hf", "nanogpt")}


@pytest.fixture(scope="module")
def layout_losses() -> dict[str, list[float]]:
    losses = {}
    for world_size in sorted({w for _, w, *_ in LAYOUTS.values()}):
        names = [n for n, (_, w, *_) in LAYOUTS.items() if w == world_size]
        losses.update(run_distributed(train_layouts, world_size, names, timeout=900)[0])
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(layout, references, layout_losses):
    reference, losses = references[LAYOUTS[layout][0]], layout_losses[layout]
    assert reference[-1] < reference[0] - 1.0, "the reference run must learn"
    assert losses == pytest.approx(reference, rel=1e-5)


def nanogpt_moe_under_apply_ep() -> tuple[list[float], list[float]]:
    """Worker: a nanoGPT whose MLPs are weft's MoE layer (4 experts, top 2), its experts spread over
    the 2 ranks by `apply_ep` alone, each rank on its half of every batch and the other gradients
    averaged by hand (what any data-parallel wrapper does). (Its losses, one process's.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from weft.parallelisms.ep import apply_ep, expert_parameters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    whole = NanoGPT(n_experts=4)
    split = NanoGPT(n_experts=4)
    split.load_state_dict(whole.state_dict())
    apply_ep(split, init_device_mesh("cpu", (world,)))
    experts = {id(p) for _, p in expert_parameters(split)}
    losses = {"ep": [], "one process": []}
    for model, name in ((split, "ep"), (whole, "one process")):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in batches():
            rows = batch.chunk(world)[rank] if model is split else batch
            loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
            loss.backward()
            if model is split:  # apply_ep made the experts' gradient the mean over the ranks already
                for param in model.parameters():
                    if id(param) not in experts:
                        dist.all_reduce(param.grad)
                        param.grad /= world
                loss = loss.detach()
                dist.all_reduce(loss)
                loss /= world
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return losses["ep"], losses["one process"]


@pytest.mark.slow
def test_apply_ep_alone_trains_a_nanogpt_with_moe_mlps_as_one_process():
    for ep, reference in run_distributed(nanogpt_moe_under_apply_ep, 2):
        assert reference[-1] < reference[0] - 1.0, "the reference run must learn"
        assert ep == pytest.approx(reference, rel=1e-5)


def tp_compiled_backward() -> str:
    """Worker: the HF model under tp 2 with compile forced on (apply_compile by hand), one backward."""
    from weft.parallelisms.compile import apply_compile

    meshes = ParallelDims.resolve(dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2).build_mesh("cpu")
    model = parallelize(build("hf"), meshes, ParallelizeOptions(fsdp=FSDPOptions(param_dtype=torch.float32)))
    apply_compile(model, CompileOptions(backend=COMPILE_BACKEND))
    materialize(model, "cpu", seed=SEED)
    try:
        logits_of(model, "hf", torch.zeros(1, SEQ_LEN, dtype=torch.long), None).sum().backward()
    except AttributeError as e:
        return str(e)
    return "ok"


@pytest.mark.slow
@pytest.mark.skipif(not torch_has_tp_compile_bug(), reason="this torch has no known TP + compile bug")
def test_torch_bug_behind_the_tp_compile_refusal_still_exists():
    assert run_distributed(tp_compiled_backward, 2) == ["'Tensor' object has no attribute '_local_tensor'"] * 2


def test_parallelize_refuses_tp_with_compile_where_torch_cannot():
    class Meshes:  # parallelize reads the degrees before touching any mesh
        dims = ParallelDims.resolve(dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2)

    if not torch_has_tp_compile_bug():
        pytest.skip("this torch compiles tensor-parallel blocks")
    with pytest.raises(TransformError, match="^parallelize: compile with tensor parallelism and activation "
                                             "checkpointing fails in torch"):
        parallelize(nn.Linear(2, 2), Meshes(), ParallelizeOptions(compile=CompileOptions(), ac=ACOptions("full")))
