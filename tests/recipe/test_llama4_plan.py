"""What train.py does not run Llama 4 in yet is refused in one line naming the key."""

import pytest

from weft.components.config import ConfigError, parse_args
from weft.recipe.plan import model_and_layout


@pytest.mark.parametrize(("overrides", "message"), [
    (["--parallelism.tp", "2", "--parallelism.dp_shard", "1"],
     "parallelism.tp = 2: model flavor debugmodel_moe (Llama 4) trains with data and pipeline parallelism "
     "(dp_shard, dp_replicate, pp) only so far; set parallelism.tp = 1"),
    (["--parallelism.cp", "2", "--parallelism.dp_shard", "1"],
     "parallelism.cp = 2: model flavor debugmodel_moe (Llama 4) trains with data and pipeline parallelism "
     "(dp_shard, dp_replicate, pp) only so far; set parallelism.cp = 1"),
    (["--lora.enable"], "lora.enable: model flavor debugmodel_moe (Llama 4) has no LoRA targets yet; "
                        "fine-tune it fully (no lora.enable)"),
])
def test_unsupported_llama4_layouts_are_refused(overrides, message):
    cfg = parse_args(["--job.config_file", "debug_moe", *overrides])
    with pytest.raises(ConfigError) as caught:
        model_and_layout(cfg, world_size=2)
    assert str(caught.value) == message


def test_debug_moe_plans_with_fsdp():
    args, dims = model_and_layout(parse_args(["--job.config_file", "debug_moe"]), world_size=2)
    assert (args.n_experts, dims.dp_shard) == (4, 2)


def test_dry_run_table_lists_only_the_layouts_llama4_trains_in(capsys):
    """The table of other layouts leaves out those the plan refuses (it raised inside them)."""
    from weft import train

    code = train.main(["--job.config_file", "debug_moe", "--job.dry_run", "--job.dry_run_world_size", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    table = out.split("layouts of 4 ranks", 1)[1].splitlines()[2:]
    rows = [line.split()[:4] for line in table if line.strip() and line.split()[0].isdigit()]
    expected = [[str(k) for k in row] for row in ((1, 4, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1))]
    assert sorted(rows) == expected  # pp dp_shard cp tp; tp and cp: refused for Llama 4 so far
