"""What train.py cannot run Llama 4 in is refused in one line naming the key; the rest plans."""

import pytest

from weft.components.config import ConfigError, parse_args
from weft.models import flavors
from weft.parallelisms.parallel_dims import LayoutError
from weft.recipe.plan import model_and_layout


@pytest.mark.parametrize(("overrides", "world_size", "message"), [
    (["--parallelism.dp_shard", "1", "--parallelism.tp", "4", "--parallelism.ep", "2"], 4,
     "parallelism.ep = 2 must divide dp_shard·cp·tp = 1·1·4 = 4 and be a multiple of tp = 4: expert parallelism "
     "borrows its ranks from FSDP's and tensor parallelism's"),
    (["--parallelism.dp_shard", "1", "--parallelism.dp_replicate", "2", "--parallelism.ep", "2"], 2,
     "parallelism.ep = 2 must divide dp_shard·cp·tp = 1·1·1 = 1 and be a multiple of tp = 1: expert parallelism "
     "borrows its ranks from FSDP's and tensor parallelism's"),
    (["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--parallelism.ep", "2"], 4,
     "parallelism.ep = 2: expert parallelism composes with dp_shard, cp, tp and pp so far, not parallelism.dp_replicate = 2"),
    (["--parallelism.ep", "2", "--compile.enable"], 2,
     "parallelism.ep = 2: the all-to-all's split sizes are read on the host, which compile cannot trace; "
     "set compile.enable = false"),
])
def test_unsupported_llama4_layouts_are_refused(overrides, world_size, message):
    cfg = parse_args(["--job.config_file", "debug_moe", *overrides])
    with pytest.raises((ConfigError, LayoutError)) as caught:
        model_and_layout(cfg, world_size=world_size, device_type="cpu")
    assert str(caught.value) == message


@pytest.mark.parametrize(("config", "world_size", "message"), [
    ("debug_moe", 8, "parallelism.ep = 8 does not divide the 4 experts of model flavor debugmodel_moe; each rank "
                     "holds as many experts as the others"),
    ("debug_model", 2, "parallelism.ep = 2: model flavor debugmodel has no experts to spread; set parallelism.ep = 1"),
])
def test_expert_parallel_degrees_the_experts_cannot_take_are_refused(config, world_size, message):
    cfg = parse_args(["--job.config_file", config, "--parallelism.ep", str(world_size)])
    with pytest.raises(ConfigError) as caught:
        model_and_layout(cfg, world_size=world_size, device_type="cpu")
    assert str(caught.value) == message


def test_debug_moe_plans_with_fsdp_tp_cp_and_lora():
    _, args, dims = model_and_layout(parse_args(["--job.config_file", "debug_moe"]), world_size=2, device_type="cpu")
    assert (args.n_experts, dims.dp_shard) == (4, 2)
    for key in ("tp", "cp"):
        *_, dims = model_and_layout(parse_args(["--job.config_file", "debug_moe", "--parallelism.dp_shard", "1",
                                               f"--parallelism.{key}", "2"]), world_size=2, device_type="cpu")
        assert getattr(dims, key) == 2
    model_and_layout(parse_args(["--job.config_file", "debug_moe", "--lora.enable"]), world_size=1, device_type="cpu")


def test_dry_run_table_lists_the_layouts_llama4_trains_in(capsys):
    """Every product of pp, dp_shard, cp and tp of 4 ranks that the debug MoE's 4 blocks and
    128-token sequences allow (the table leaves out what the plan refuses), and with each an ep
    that divides dp_shard × cp × tp and is a multiple of tp (all divide its 4 experts); the printed
    table has an ep column."""
    from weft import train
    from weft.recipe.dry_run import candidate_layouts

    cfg = parse_args(["--job.config_file", "debug_moe"])
    listed = [(d.pp, d.dp_shard, d.cp, d.tp, d.ep) for d in candidate_layouts(cfg, flavors()["debugmodel_moe"], 4)]
    expected = [(pp, dp, cp, tp, ep) for pp in (1, 2, 4) for dp in (1, 2, 4) for cp in (1, 2, 4) for tp in (1, 2, 4)
                for ep in (1, 2, 4) if pp * dp * cp * tp == 4 and (ep == 1 or (dp * cp * tp % ep == 0 and ep % tp == 0))]
    assert sorted(listed) == sorted(expected) and len(listed) == 24
    assert train.main(["--job.config_file", "debug_moe", "--job.dry_run", "--job.dry_run_world_size", "4"]) == 0
    table = capsys.readouterr().out.split("layouts of 4 ranks", 1)[1].splitlines()
    assert table[1].split() == ["pp", "dp_shard", "cp", "tp", "ep", "peak", "MiB"] and "(12 more" in table[14]