"""parallelisms/pipeline.py: splitting a model into stages, placing them on ranks, checking layouts.

The references: the unsplit model (its parameters, its forward), torch's own schedule classes,
and the formulas the docstrings state. Multi-process training is in test_pipeline_parity.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from weft import train
from weft.components.config.schema import PIPELINE_SCHEDULES
from weft.models.llama import LLAMA_FLAVORS, Transformer
from weft.parallelisms.common import TransformError
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import LayoutError
from weft.parallelisms.parallelize import pipeline_reshard_policy
from weft.parallelisms.pipeline import (
    default_split,
    plan_pipeline,
    split_model,
    stage_ids,
    stages_per_rank,
)

from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.own_models import NanoGPT

DEBUG = LLAMA_FLAVORS["debugmodel"]  # 4 blocks


def meta_llama() -> Transformer:
    with torch.device("meta"):
        return Transformer(DEBUG)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_default_split_spreads_units_evenly_in_model_order(n_stages):
    split = default_split(meta_llama(), n_stages)
    units = [["tok_embeddings"], ["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"], ["norm", "output"]]
    assert [name for stage in split for name in stage] == [name for unit in units for name in unit]
    sizes = [sum(1 for unit in units if unit[0] in stage) for stage in split]  # units per stage
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert split[0][0] == "tok_embeddings" and split[-1][-2:] == ["norm", "output"]


def test_split_partitions_the_parameters_under_their_full_names():
    model = meta_llama()
    stages = split_model(model, default_split(model, 4))
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    full = {n: p.shape for n, p in model.named_parameters()}
    assert sorted(names) == sorted(full)  # each parameter in exactly one stage
    assert all(p.shape == full[n] for stage in stages for n, p in stage.named_parameters())
    assert stages[0].norm is None and stages[-1].tok_embeddings is None


def test_stages_materialise_to_the_full_models_weights_and_chain_to_its_logits():
    """Each stage, materialised on its own with the seed, holds the full model's values (seeded by
    name), and feeding each stage's output to the next gives the unsplit model's logits."""
    model = materialize(meta_llama(), "cpu", seed=3)
    stages = [materialize(stage, "cpu", seed=3) for stage in split_model(meta_llama(), default_split(meta_llama(), 3))]
    weights = dict(model.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, weights[name]), name
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, -1)
    hidden = tokens
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden, positions)
        torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)


def test_transformers_llama_split_keeps_its_names():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    split = default_split(model, 2)
    assert split == [["model.embed_tokens", "model.layers.0", "model.layers.1"],
                     ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    stages = split_model(model, split)
    assert sorted(n for s in stages for n, _ in s.named_parameters()) == sorted(n for n, _ in model.named_parameters())


class NanoGPTWithUnits(NanoGPT):
    """A model of one's own that declares its pipeline units, as weft's Decoder does."""

    def pipeline_units(self) -> list[list[str]]:
        blocks = ([f"transformer.h.{i}"] for i in range(len(self.transformer.h)))
        return [["transformer.wte", "transformer.wpe"], *blocks, ["transformer.ln_f", "lm_head"]]


def test_a_model_that_declares_its_units_is_split_by_them():
    with torch.device("meta"):
        declared, plain = NanoGPTWithUnits(n_layer=2), NanoGPT(n_layer=2)
    assert default_split(declared, 2) == [["transformer.wte", "transformer.wpe", "transformer.h.0"],
                                          ["transformer.h.1", "transformer.ln_f", "lm_head"]]
    with pytest.raises(LayoutError, match="no default split for NanoGPT; pass module names per stage"):
        default_split(plain, 2)


def test_split_refuses_unknown_and_doubly_owned_names():
    with pytest.raises(LayoutError, match="'layers.9', which is not a module"):
        split_model(meta_llama(), [["tok_embeddings", "layers.9"], ["norm"]])
    with pytest.raises(LayoutError, match="'layers.0' is named by stages 0 and 1"):
        split_model(meta_llama(), [["layers.0"], ["layers.0"]])


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_stage_lives_on_exactly_one_rank(schedule, pp):
    per_rank = stages_per_rank(schedule)
    assert per_rank == (2 if issubclass(get_schedule_class(schedule), PipelineScheduleMulti) else 1)
    placed = [stage_ids(schedule, rank, pp, per_rank) for rank in range(pp)]
    assert sorted(s for ids in placed for s in ids) == list(range(pp * per_rank))
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # V order: rank 0 holds the first and the last stage
        assert placed[0] == [0, 2 * pp - 1] and placed[-1] == [pp - 1, pp]
    else:  # loop order
        assert all(ids == list(range(rank, pp * per_rank, pp)) for rank, ids in enumerate(placed))


LAYOUT = dict(pp=2, stages_per_rank_requested=0, microbatches=0, local_batch_size=4, n_blocks=4,
              tied_embeddings=False)


@pytest.mark.parametrize("change, message", [
    (dict(pp=4, schedule="Interleaved1F1B"), "parallelism.pp = 4 × 2 stages per rank = 8 stages, more than the model's 4 blocks"),
    (dict(microbatches=3), "parallelism.pp_microbatches = 3 does not divide training.local_batch_size = 4"),
    (dict(microbatches=1), "needs at least as many micro-batches as stages (2); got parallelism.pp_microbatches = 1"),
    (dict(schedule="DualPipeV", microbatches=2), "needs at least as many micro-batches as stages (4)"),
    (dict(schedule="Interleaved1F1B", stages_per_rank_requested=1), "runs several stages per rank; parallelism.pp_stages_per_rank = 1"),
    (dict(schedule="ZBVZeroBubble", stages_per_rank_requested=3, n_blocks=8), "exactly 2 stages per rank"),
    (dict(stages_per_rank_requested=2), "runs one stage per rank"),
    (dict(tied_embeddings=True), "ties its output projection"),
    (dict(schedule="Interleaved1F1B", local_batch_size=10, microbatches=5), "not a multiple of its 2 rounds"),
])
def test_bad_pipeline_layouts(change, message):
    kwargs = dict(LAYOUT, schedule="1F1B") | change
    with pytest.raises(LayoutError) as error:
        plan_pipeline(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_fsdp_keeps_stage_parameters_gathered_and_refuses_resharding_for_split_backward():
    assert pipeline_reshard_policy("default", None) == "default"
    assert pipeline_reshard_policy("default", "1F1B") == "never"
    assert pipeline_reshard_policy("always", "1F1B") == "always"
    with pytest.raises(TransformError, match="'always' gives wrong gradients under the ZBVZeroBubble"):
        pipeline_reshard_policy("always", "ZBVZeroBubble")


BASE = ["--job.config_file", "debug_model", "--training.steps", "2", "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--no-metrics.enable_tensorboard"]


@pytest.mark.parametrize("extra, expected", [
    (["--parallelism.pp", "2"], "parallelism.pp = 2 does not divide the world size 1"),
    (["--parallelism.pp", "3", "--job.simulate_world_size", "6", "--parallelism.pp_schedule", "Interleaved1F1B"],
     "6 stages, more than the model's 4 blocks"),
    (["--parallelism.pp", "2", "--job.simulate_world_size", "2", "--parallelism.pp_microbatches", "3"],
     "parallelism.pp_microbatches = 3 does not divide training.local_batch_size = 4"),
    (["--parallelism.pp", "2", "--job.simulate_world_size", "2", "--parallelism.pp_microbatches", "1"],
     "needs at least as many micro-batches as stages (2)"),
    (["--parallelism.pp", "2", "--job.simulate_world_size", "2", "--parallelism.pp_schedule", "LoopedBFS",
      "--parallelism.pp_stages_per_rank", "1"], "runs several stages per rank"),
    (["--parallelism.pp_schedule", "ZBV"], "--parallelism.pp_schedule: expected one of"),
    (["--parallelism.pp", "2", "--job.simulate_world_size", "4", "--parallelism.pp_schedule", "DualPipeV",
      "--parallelism.fsdp_reshard_after_forward", "always"], "'always' gives wrong gradients"),
])
def test_bad_pipeline_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, expected):
    argv = BASE + ["--job.dump_folder", str(tmp_path / "out")] + extra
    before = snapshot(tmp_path)
    assert_clean_failure(run_in_process(train.main, argv, capsys), expected, before=before, root=tmp_path)


# ---------------------------------------------------------------------------------------------
# A transformers Llama through torch's schedules equals the unsplit model
# ---------------------------------------------------------------------------------------------

HF_STEPS = 5


def tiny_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each micro-batch's summed token loss over the whole batch's token count: the schedule adds
    micro-batch gradients without rescaling them, so they sum to the mean loss's gradient."""
    count = hf_batch()[1].numel()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / count


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_transformers_llama_stages_chain_to_the_unsplit_logits(attention):
    """Three stages run one after another give the unsplit model's logits, whichever attention
    implementation reads the causal mask (eager takes it as a tensor; sdpa may skip it)."""
    pytest.importorskip("transformers")
    model = tiny_hf_llama()
    model.config._attn_implementation = attention
    inputs, _ = hf_batch()
    stages = split_model(model, default_split(model, 3))
    hidden = inputs
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden)
        want = model(input_ids=inputs, use_cache=False).logits
    torch.testing.assert_close(hidden, want, rtol=1e-6, atol=1e-6)


def train_hf_in_one_process() -> tuple[list[float], dict[str, np.ndarray]]:
    model = tiny_hf_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, labels = hf_batch()
    losses = []
    for _ in range(HF_STEPS):
        loss = mean_token_loss(model(input_ids=inputs, use_cache=False).logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def train_hf_pipelines(schedules: list[str]) -> dict[str, tuple[list[float], dict[str, np.ndarray]]]:
    """Worker (pp 2): for each schedule, the tiny transformers Llama split by `default_split`, run by
    torch's schedule over 2 micro-batches; the loss of every step and this rank's final weights."""
    import torch.distributed as dist

    from weft.parallelisms.pipeline import build_schedule

    results = {}
    for schedule in schedules:
        per_rank = stages_per_rank(schedule)
        ids = stage_ids(schedule, dist.get_rank(), 2, per_rank)
        model = tiny_hf_llama()
        stages = split_model(model, default_split(model, 2 * per_rank), ids)
        run = build_schedule(stages, ids, 2 * per_rank, schedule=schedule, microbatches=2, loss_fn=mean_token_loss,
                             device=torch.device("cpu"), pp_group=dist.group.WORLD)
        optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-2)
        inputs, labels = hf_batch()
        losses = []
        for _ in range(HF_STEPS):
            parts: list[torch.Tensor] = []
            run.step(inputs, target=labels, losses=parts, return_outputs=False)
            optimizer.step()
            optimizer.zero_grad()
            loss = torch.stack(parts).sum() if parts else torch.zeros(())
            dist.all_reduce(loss)  # from the rank with the last stage
            losses.append(loss.item())
        results[schedule] = (losses, {n: p.detach().numpy().copy() for s in stages for n, p in s.named_parameters()})
    return results


@pytest.mark.slow
def test_a_transformers_llama_trains_under_pp_2_like_the_unsplit_model():
    """pp 2 with 1F1B (one stage a rank) and Interleaved1F1B (two, in loop order): every step's loss
    and every final weight equal the unsplit transformers model's in one process."""
    pytest.importorskip("transformers")
    from weft.components.distributed.cpu_ranks import run_distributed

    want_losses, want_weights = train_hf_in_one_process()
    assert want_losses[-1] < want_losses[0] - 0.3, "the reference must learn"
    schedules = ["1F1B", "Interleaved1F1B"]
    ranks = run_distributed(train_hf_pipelines, 2, schedules)
    for schedule in schedules:
        assert ranks[0][schedule][0] == pytest.approx(want_losses, rel=1e-5), schedule
        weights = {**ranks[0][schedule][1], **ranks[1][schedule][1]}
        assert weights.keys() == want_weights.keys()
        for name, want in want_weights.items():  # as a whole tensor: AdamW magnifies rounding in near-zero gradients
            error = float(np.linalg.norm(weights[name] - want) / np.linalg.norm(want))
            assert error <= 1e-5, f"{schedule} {name}: relative difference {error:.2e}"
