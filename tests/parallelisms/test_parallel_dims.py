import pytest

from weft.parallelisms.parallel_dims import LayoutError, ParallelDims


def resolve(world_size, dp_replicate=1, dp_shard=-1, cp=1, tp=1):
    return ParallelDims.resolve(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size)


def test_dp_shard_takes_the_rest_of_the_world():
    dims = resolve(16, dp_replicate=2, cp=2, tp=2)
    assert (dims.dp_shard, dims.dp) == (2, 4)
    assert dims.fsdp_enabled and not dims.ddp_enabled


def test_pure_replication_is_ddp():
    dims = resolve(4, dp_replicate=4)
    assert dims.dp_shard == 1 and dims.ddp_enabled and not dims.fsdp_enabled


def test_cp_alone_shards_parameters():
    dims = resolve(2, dp_shard=1, cp=2)
    assert dims.fsdp_enabled and dims.dp == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, dp_shard=3), "dp_replicate·dp_shard·cp·tp = 1·3·1·1 = 3 does not equal the world size 8"),
        (dict(world_size=6, tp=4), "world size 6 is not divisible by dp_replicate·cp·tp = 1·1·4 = 4"),
        (dict(world_size=4, tp=0), "parallelism.tp must be >= 1, got 0"),
        (dict(world_size=4, dp_shard=0), "parallelism.dp_shard must be -1 or >= 1, got 0"),
        (dict(world_size=4, cp=-2), "parallelism.cp must be >= 1, got -2"),
    ],
)
def test_invalid_layouts(kwargs, message):
    with pytest.raises(LayoutError) as error:
        resolve(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cp_needs_sequence_divisible_by_twice_cp():
    with pytest.raises(LayoutError, match="divisible by 2·cp = 8, got 12"):
        resolve(4, dp_shard=1, cp=4).check_seq_len(12)


def test_sequence_parallel_needs_local_sequence_divisible_by_tp():
    with pytest.raises(LayoutError, match="training.seq_len / cp = 6 divisible by tp = 4"):
        resolve(8, dp_shard=1, cp=2, tp=4).check_seq_len(12)


def test_mesh_sizes_are_named():
    """Seven integers in a row are easy to misorder: each size is passed by its name."""
    with pytest.raises(TypeError):
        ParallelDims(1, 2, 1, 2, 4)
    assert ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, world_size=4) == resolve(4, tp=2)


def test_pp_is_outermost_and_dp_shard_takes_what_it_leaves():
    dims = ParallelDims.resolve(world_size=16, tp=2, pp=4)
    assert (dims.pp, dims.dp_shard, dims.dp, dims.stage_world_size) == (4, 2, 2, 4)
    assert dims.pp_enabled and dims.fsdp_enabled
    assert dims.describe().startswith("pp=4 dp_replicate=1 dp_shard=2")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=6, pp=4), "parallelism.pp = 4 does not divide the world size 6"),
        (dict(world_size=8, pp=2, tp=8), "world size 8 is not divisible by pp·dp_replicate·cp·tp = 2·1·1·8 = 16"),
        (dict(world_size=8, pp=2, dp_shard=2), "pp·dp_replicate·dp_shard·cp·tp = 2·1·2·1·1 = 4 does not equal"),
        (dict(world_size=8, pp=0), "parallelism.pp must be >= 1, got 0"),
    ],
)
def test_invalid_pipeline_layouts(kwargs, message):
    with pytest.raises(LayoutError) as error:
        ParallelDims.resolve(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)
