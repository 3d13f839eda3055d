"""The dry run of every published Qwen3 flavor prints its parameter counts (total, and active per
token for Qwen3-MoE) as issue 37 gives them from transformers and the model cards."""

import re

import pytest

from weft import train

from tests.support.published import QWEN3_PUBLISHED


@pytest.mark.parametrize("flavor", sorted(QWEN3_PUBLISHED))
def test_the_dry_run_prints_the_published_parameter_counts(flavor, capsys):
    argv = ["--job.config_file", "debug_model", "--model.flavor", flavor, "--job.dry_run",
            "--job.dry_run_world_size", "8", "--job.dry_run_device_memory_gib", "100000"]
    assert train.main(argv) == 0
    total, active = QWEN3_PUBLISHED[flavor]
    counts = f"{total:,} parameters" + (f" ({active:,} active per token)" if active != total else "")
    assert f"model {flavor}: {counts}, " in capsys.readouterr().out


def test_the_dry_run_table_lists_qwen3_moe_tp_layouts_with_and_without_ep():
    """Qwen3-MoE's experts split by hidden dimension under tp alone
    (tests/parallelisms/test_qwen3_tp_plan.py), so of 4 ranks' products of pp, dp_shard, cp, tp and
    ep the table lists every one with ep 1 and those whose ep is a multiple of tp dividing
    dp_shard × cp × tp; dense Qwen3 keeps its tp layouts."""
    from weft.components.config import parse_args
    from weft.models.qwen3 import QWEN3_FLAVORS
    from weft.recipe.dry_run import candidate_layouts

    cfg = parse_args(["--job.config_file", "debug_model", "--training.seq_len", "128"])

    def listed(flavor: str) -> list[tuple[int, ...]]:
        return sorted((d.pp, d.dp_shard, d.cp, d.tp, d.ep) for d in candidate_layouts(cfg, QWEN3_FLAVORS[flavor], 4))

    products = [(pp, dp, cp, tp) for pp in (1, 2, 4) for dp in (1, 2, 4) for cp in (1, 2, 4) for tp in (1, 2, 4)
                if pp * dp * cp * tp == 4]
    moe = [(*p, ep) for p in products for ep in (1, 2, 4)
           if ep == 1 or (p[1] * p[2] * p[3] % ep == 0 and ep % p[3] == 0)]
    assert listed("debugmodel_qwen3_moe") == sorted(moe) and {(1, 2, 1, 2, 2), (1, 2, 1, 2, 1)} <= set(moe)
    # the dense flavor ties its embeddings: no pipeline; no experts: ep 1
    assert listed("debugmodel_qwen3") == sorted((*p, 1) for p in products if p[0] == 1)


def test_pp_refuses_the_tied_debug_flavor_in_one_line_and_plans_the_untied_one(capsys):
    """The dry run of pp 2 on `debugmodel_qwen3` (tied) exits 2 with one line naming the key, its
    value and the flavor; `debugmodel_qwen3_untied` plans, and its table lists pipeline layouts."""
    from weft.components.config import parse_args
    from weft.models.qwen3 import QWEN3_FLAVORS
    from weft.recipe.dry_run import candidate_layouts

    argv = ["--job.config_file", "debug_model", "--parallelism.pp", "2", "--parallelism.dp_shard", "1",
            "--parallelism.pp_microbatches", "2", "--job.dry_run", "--job.dry_run_world_size", "2"]
    assert train.main([*argv, "--model.flavor", "debugmodel_qwen3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "weft: error: parallelism.pp = 2: model flavor debugmodel_qwen3 ties its output projection to the token "
        "embedding, which the first and the last pipeline stage cannot share; use a flavor with untied embeddings "
        "or parallelism.pp = 1")
    assert train.main([*argv, "--model.flavor", "debugmodel_qwen3_untied"]) == 0
    cfg = parse_args(["--job.config_file", "debug_model", "--training.seq_len", "128"])
    assert {d.pp for d in candidate_layouts(cfg, QWEN3_FLAVORS["debugmodel_qwen3_untied"], 4)} == {1, 2, 4}


@pytest.mark.parametrize("config", ["qwen3_8b_lora", "qwen3_30b_a3b_qlora"])
def test_a_lora_dry_run_prints_the_flavors_counts_and_the_adapters_apart(config, capsys):
    """The model line counts the flavor's own weights (the published counts); the adapters are
    apply_lora's trainable parameters, and the rank holds both."""
    assert train.main(["--job.config_file", config, "--job.dry_run", "--job.dry_run_device_memory_gib", "100000"]) == 0
    out = capsys.readouterr().out
    flavor = "qwen3_8b" if config == "qwen3_8b_lora" else "qwen3_30b_a3b"
    total, active = QWEN3_PUBLISHED[flavor]
    trainable = int(re.search(r"trainable ([\d,]+) of", out).group(1).replace(",", ""))
    counts = f"{total:,} parameters" + (f" ({active:,} active per token)" if active != total else "")
    assert f"model {flavor}: {counts}, {total + trainable:,} on each rank (the LoRA adapters included)" in out
