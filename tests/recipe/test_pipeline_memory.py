"""The dry run's per-stage memory estimate under pipeline parallelism against real gloo runs.

Each rank of pp 2 and pp 2 × fsdp 2 (debug model, fp32, seq 256, local batch 4 in 4 micro-batches)
builds the dry run's estimate for its own stages (`recipe.dry_run.pipeline_step_shape`: blocks and
micro-batches in flight counted along torch's schedule, the embedding on the first stage, the
output and logits on the last) and measures its peak over one steady-state step of the recipe's
`train_step`: the bytes live at the start (parameters, optimizer state, buffers) plus the highest
running total of the CPU allocator during the step (torch's profiler), as tests/components/test_memory.py
does. The estimate must be within 10% of the measured peak on the first and on the last stage.
"""

from __future__ import annotations

import pytest
import torch

from weft.components.config import parse_args

from tests.support.dist_utils import run_distributed

SCHEDULES = ("1F1B", "GPipe")
LAYOUTS = {2: ["--parallelism.dp_shard", "1"], 4: ["--parallelism.dp_shard", "2"]}


def measure(world_size: int) -> dict[str, tuple[list[int], int, int]]:
    """Worker: per schedule, this rank's stage ids, measured peak and estimated peak (bytes)."""
    import torch.distributed as dist

    from weft.components.data import Batch
    from weft.components.memory import estimate_memory, local_tensor, measured_peak_bytes
    from weft.recipe.build import build_model, build_trainer
    from weft.recipe.dry_run import pipeline_step_shape, step_shape
    from weft.recipe.plan import RunPlan
    from weft.recipe.step import train_step

    def size(tensors) -> int:
        return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)

    results = {}
    for schedule in SCHEDULES:
        cfg = parse_args(["--job.config_file", "debug_model", "--training.seq_len", "256",
                          "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32",
                          "--training.mixed_precision_reduce", "float32", "--parallelism.pp", "2",
                          "--parallelism.pp_microbatches", "4", "--parallelism.pp_schedule", schedule,
                          *LAYOUTS[world_size]])
        plan = RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)
        meshes = plan.dims.build_mesh("cpu")
        planned = build_model(plan, meshes, device=None)
        shape = pipeline_step_shape(step_shape(cfg, plan.model_args, plan.dims), plan.pipeline, planned,
                                    meshes.pp.get_group(), meshes.pp.get_local_rank())
        estimate = estimate_memory(planned, shape)
        trainer = build_trainer(plan, meshes, torch.device("cpu"))
        model, optimizer, setup = trainer.model, trainer.optimizer, trainer.step
        generator = torch.Generator().manual_seed(dist.get_rank())

        def step():
            tokens = torch.randint(0, plan.model_args.vocab_size, (4, 257), generator=generator)
            train_step(setup, [Batch(tokens[:, :-1], tokens[:, 1:], None, None)])

        step()  # warm-up: creates the optimizer state
        optimizer.zero_grad(set_to_none=True)
        held = size(model.parameters()) + size(model.buffers()) + size(
            t for state in optimizer.state.values() for key, t in state.items() if key != "step")
        results[schedule] = (model.stage_ids, held + measured_peak_bytes(step), estimate.peak)
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def measured() -> dict[int, list[dict[str, tuple[list[int], int, int]]]]:
    return {world: run_distributed(measure, world, world, timeout=600) for world in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", list(LAYOUTS), ids=["pp2", "pp2_fsdp2"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_estimate_within_10_percent_of_measured_peak(measured, world_size, schedule):
    stages = set()
    for rank_results in measured[world_size]:
        ids, peak, estimate = rank_results[schedule]
        stages.update(ids)
        assert estimate == pytest.approx(peak, rel=0.10), f"stages {ids}: estimated {estimate:,}, measured {peak:,}"
    assert stages == {0, 1}, "both the first and the last stage were measured"
