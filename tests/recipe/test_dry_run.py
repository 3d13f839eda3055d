"""--job.dry_run: plans through the same transforms as a real run, writes nothing, exits 2 with
the figures when the layout does not fit; the layouts table's parameter counts equal the real
transforms'; every shipped config plans in under a minute and a few GB."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from weft import train
from weft.components.config import parse_args
from weft.components.distributed.processes import init_fake_distributed
from weft.components.memory import device_memory_gib, tp_fsdp_state_bytes, training_state_bytes
from weft.models import flavors, spec_for_args
from weft.parallelisms.parallel_dims import ParallelDims
from weft.parallelisms.parallelize import parallelize
from weft.recipe.dry_run import planned_world_size
from weft.recipe.plan import RunPlan

from tests.support import REPO


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    dump = tmp_path / "out"
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--job.dry_run",
            "--job.dry_run_world_size", "4", "--parallelism.tp", "2", "--job.dry_run_device_memory_gib", "a100-40gb"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    for expected in ("mesh: dp_replicate=1 dp_shard=2 cp=1 tp=2 (world size 4)", "apply_tp:", "apply_fsdp:",
                     "1,000,576 on each rank", "2,048 tokens per step", "optimizer state", "<- this run", "fits:"):
        assert expected in out
    assert not dump.exists() and not dist.is_initialized()


def test_dry_run_adds_the_kv_cache_a_local_batch_would_generate_with(capsys):
    """Keys and values of every layer, kv heads split by tp 2: 2 x layers x rows x kv_heads/2 x seq_len x
    head_dim x bytes, plus each slot's position and validity (Llama 3 8B: 32 layers, 8 kv heads of 128)."""
    argv = ["--job.config_file", "llama8b", "--job.dry_run", "--job.dry_run_world_size", "8", "--parallelism.tp", "2",
            "--no-compile.enable", "--training.local_batch_size", "2"]
    assert train.main(argv) == 0
    line = [line for line in capsys.readouterr().out.splitlines() if "KV cache to generate" in line]
    args = flavors()["llama3_8b"]
    want = (2 * args.n_layers * 2 * args.n_kv_heads * 8192 * (args.dim // args.n_heads) * 2 + 2 * 8192 * 9) / 2
    assert want / 2**30 == pytest.approx(1.0, abs=0.01)  # 2 x 32 x 2 x 8 x 8192 x 128 x 2 bytes / 2
    assert line == [f"  KV cache to generate 2 sequences of 8192 tokens (bfloat16): {want / 2**30:.2f} GiB per device "
                    "(generation only, not in the training peak)"]


def test_a_layout_that_does_not_fit_exits_2_with_the_figures(capsys):
    argv = ["--job.config_file", "llama8b", "--job.dry_run", "--job.dry_run_world_size", "8",
            "--job.dry_run_device_memory_gib", "4090"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("weft: error: job.dry_run_device_memory_gib = 4090: does not fit")
    assert "exceeds 23.6 GiB by" in err[0] and "parameters 3.74" in err[0]


def test_a_layout_that_fails_at_start_fails_the_dry_run_with_the_same_error(tmp_path, capsys):
    """tp 3 cannot split 8 heads: the dry run and a (simulated) real start say the same line."""
    common = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "x"), "--parallelism.tp", "3",
              "--parallelism.dp_shard", "1", "--training.seq_len", "96", "--no-metrics.enable_tensorboard"]
    assert train.main(common + ["--job.dry_run", "--job.dry_run_world_size", "3"]) == 2
    dry = capsys.readouterr().err
    assert train.main(common + ["--job.simulate_world_size", "3"]) == 2
    real = capsys.readouterr().err
    assert dry == real and dry.startswith("weft: error: parallelism.tp = 3")


def test_the_planned_world_is_the_product_of_the_degrees_pipeline_included():
    """llama3_405b asks pp 8 x tp 8 and no world size: the dry run plans its 64 ranks."""
    cfg = parse_args(["--job.config_file", "llama3_405b"])
    assert (cfg.parallelism.pp, cfg.parallelism.tp, cfg.job.dry_run_world_size) == (8, 8, 0)
    assert planned_world_size(cfg) == 64
    assert planned_world_size(parse_args(["--job.config_file", "llama3_405b", "--job.dry_run_world_size", "128"])) == 128


def test_a_world_the_layout_cannot_fill_names_the_ranks_planned_and_why(capsys):
    argv = ["--job.config_file", "debug_model", "--parallelism.pp", "2", "--job.dry_run"]
    assert train.main(argv + ["--job.dry_run_world_size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("weft: error: parallelism.pp = 2 does not divide the world size 3 "
                   "(the dry run planned 3 ranks: job.dry_run_world_size)")


def test_expert_parallelism_inside_pipeline_stages_plans_each_stage(capsys):
    """pp 2 x fsdp 2 x ep 2 on the debug MoE: each pipeline rank's estimate, the all-to-all in it."""
    argv = ["--job.config_file", "debug_moe", "--job.dry_run", "--job.dry_run_world_size", "4", "--parallelism.pp", "2",
            "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--parallelism.pp_microbatches", "2"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("EP all-to-all (1 layer, 1.25x mean received)") == 2 and "pipeline rank 1 of 2" in out


# The debug model on 4 ranks with a local batch of 4 in 4 micro-batches: pipelines of 2 and 4 run.
PIPELINE_DRY_RUN = ["--job.config_file", "debug_model", "--training.local_batch_size", "4",
                    "--parallelism.pp_microbatches", "4", "--job.dry_run", "--job.dry_run_world_size", "4"]


def _dry_run_output(argv: list[str], capsys) -> tuple[list[float], dict[tuple[int, ...], float]]:
    """The planned run's peaks (MiB, one per pipeline rank printed) and the layouts table (MiB by
    (pp, dp_shard, cp, tp))."""
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    peaks = [float(line.split()[-4]) for line in out.splitlines() if line.endswith("<- peak")]
    table = out[out.index("by estimated peak:"):].splitlines()[2:]
    rows = {tuple(int(x) for x in line.split()[:4]): float(line.split()[4]) for line in table if line[:6].strip().isdigit()}
    return peaks, rows


def test_the_layouts_table_varies_pp_and_agrees_with_the_planned_pipeline(capsys):
    """The table's pipeline rows, counted from the unsplit model's shapes, equal the dry run of that
    layout, whose stages are built and parallelised for real (the larger of the first and the
    last stage's ranks); and a plain layout's table lists the same figure for it."""
    peaks, rows = _dry_run_output(PIPELINE_DRY_RUN + ["--parallelism.pp", "2", "--parallelism.dp_shard", "2"], capsys)
    assert len(peaks) == 2  # the first and the last stage's ranks
    assert rows[(2, 2, 1, 1)] == pytest.approx(max(peaks), abs=0.011)
    assert {pp for pp, *_ in rows} == {1, 2, 4}
    _, plain_rows = _dry_run_output(PIPELINE_DRY_RUN + ["--parallelism.dp_shard", "4"], capsys)
    assert plain_rows == rows


def test_a_layout_that_does_not_fit_is_told_the_pipeline_layout_that_does(capsys):
    """FSDP 4 of the debug model needs about 75 MiB; pp 2 x tp 2 about 22 MiB, the least of the
    table: the error names it, and its own dry run fits."""
    _, rows = _dry_run_output(PIPELINE_DRY_RUN + ["--parallelism.dp_shard", "4"], capsys)
    best = min(rows, key=rows.get)
    assert best[0] > 1, "the example needs a pipeline layout to be the smallest"
    limit = ["--job.dry_run_device_memory_gib", f"{(rows[best] + 0.5) / 1024:.6f}"]
    assert train.main(PIPELINE_DRY_RUN + ["--parallelism.dp_shard", "4", *limit]) == 2
    err = capsys.readouterr().err
    pp, dp_shard, cp, tp = best
    assert f"pp={pp} dp_shard={dp_shard} cp={cp} tp={tp} would need" in err and "and fits" in err
    layout = ["--parallelism.pp", str(pp), "--parallelism.dp_shard", str(dp_shard), "--parallelism.cp", str(cp),
              "--parallelism.tp", str(tp)]
    assert train.main(PIPELINE_DRY_RUN + layout + limit) == 0
    assert "fits: estimated peak" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [
    ["--lora.enable", "--lora.quantize_base", "nf4"],  # QLoRA: no tp, no pp
    ["--training.seq_len", "96", "--parallelism.pp_microbatches", "2"],  # cp and tp split 96 tokens; 2 micro-batches
])
def test_the_layouts_table_lists_exactly_the_layouts_the_plan_accepts(overrides):
    """The table asks the plan's own layout check: each factorisation of 4 ranks is listed if and
    only if a real start's plan of those degrees accepts it."""
    from weft.recipe.dry_run import candidate_layouts

    def cfg_of(*degrees):
        return parse_args(["--job.config_file", "debug_model", "--training.local_batch_size", "4", *overrides,
                           *degrees])

    listed = {(d.pp, d.dp_shard, d.cp, d.tp) for d in candidate_layouts(cfg_of(), flavors()["debugmodel"], 4)}
    accepted = set()
    for pp, dp, cp, tp in ((pp, dp, cp, tp) for pp in (1, 2, 4) for dp in (1, 2, 4) for cp in (1, 2, 4)
                           for tp in (1, 2, 4) if pp * dp * cp * tp == 4):
        cfg = cfg_of("--parallelism.pp", str(pp), "--parallelism.dp_shard", str(dp), "--parallelism.cp", str(cp),
                     "--parallelism.tp", str(tp))
        try:
            RunPlan.from_config(cfg, 4, device_type="cuda", check_environment=False)
        except ValueError:  # every UserError
            continue
        accepted.add((pp, dp, cp, tp))
    assert listed == accepted and 1 < len(listed) < 15


def test_bad_memory_value_is_one_line():
    with pytest.raises(ValueError):
        device_memory_gib("lots")
    assert device_memory_gib("h100") == 79.1 and device_memory_gib("80") == 80.0
    assert train.main(["--job.config_file", "debug_model", "--job.dry_run", "--job.dry_run_device_memory_gib",
                       "lots"]) == 2


@pytest.mark.parametrize("flavor, world_size, tp, fsdp", [
    ("debugmodel", 4, 2, 2), ("debugmodel", 8, 1, 8), ("debugmodel", 2, 2, 1), ("llama3_8b", 16, 8, 2),
    ("debugmodel_moe", 8, 1, 8),  # 4 experts on 8 ranks: stacked expert weights split along their largest dim
])
def test_layouts_table_counts_parameters_like_the_real_transforms(flavor, world_size, tp, fsdp):
    cfg = parse_args(["--job.config_file", "debug_model", "--model.flavor", flavor, "--parallelism.tp", str(tp),
                      "--parallelism.dp_shard", str(fsdp), "--parallelism.dp_replicate", str(world_size // tp // fsdp)])
    args = flavors()[flavor]
    with torch.device("meta"):
        plain, model = spec_for_args(args).build(args), spec_for_args(args).build(args)
    init_fake_distributed(world_size)
    try:
        dims = ParallelDims.resolve(dp_replicate=world_size // tp // fsdp, dp_shard=fsdp, tp=tp, world_size=world_size)
        plan = RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)
        parallelize(model, dims.build_mesh("cpu"), plan.options)
    finally:
        dist.destroy_process_group()
    assert tp_fsdp_state_bytes(plain, tp, fsdp) == training_state_bytes(model)


# Shipped configs and the world size their comments plan for.
SHIPPED = {"debug_model": 1, "debug_sft": 1, "llama8b": 8, "llama2_7b": 8, "llama8b_128k": 8, "llama3_8b_sft": 8,
           "llama3_70b": 64, "llama3_405b": 512, "debug_lora": 1, "llama3_8b_qlora": 1, "llama3_70b_lora": 8,
           "debug_moe": 1, "llama4_scout": 64, "llama4_scout_lora": 8, "llama4_scout_qlora": 1,
           "qwen3_0_6b_sft": 1, "qwen3_8b_lora": 1, "qwen3_30b_a3b_lora": 1, "qwen3_30b_a3b_qlora": 1,
           "gpt_oss_20b_qlora": 1, "gpt_oss_120b_qlora": 1, "gpt_oss_120b": 32,
           "qwen3_0_6b_dpo": 1, "llama3_8b_dpo_lora": 1, "debug_grpo": 1, "qwen3_0_6b_grpo": 1,
           "qwen3_8b_grpo_lora": 1, "debug_distill": 1, "qwen3_0_6b_distill_from_8b": 1,
           "qwen3_0_6b_distill_from_8b_lora": 1}


def test_dry_run_refuses_compile_with_tp_exactly_as_a_real_start_does(tmp_path, capsys):
    """torch 2.13 cannot compile tensor-parallel blocks under activation checkpointing: a planned run
    that asks for all three fails the dry run with the same line as a (simulated) real start."""
    from weft.parallelisms.compile import torch_has_tp_compile_bug

    if not torch_has_tp_compile_bug():
        pytest.skip("this torch compiles tensor-parallel blocks")
    common = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "x"), "--parallelism.tp", "2",
              "--compile.enable", "--no-metrics.enable_tensorboard"]
    assert train.main(common + ["--job.dry_run", "--job.dry_run_world_size", "4"]) == 0  # no AC: compiles
    capsys.readouterr()
    common += ["--activation_checkpoint.mode", "full"]
    assert train.main(common + ["--job.dry_run", "--job.dry_run_world_size", "4"]) == 2
    dry = capsys.readouterr().err
    assert train.main(common + ["--job.simulate_world_size", "4"]) == 2
    real = capsys.readouterr().err
    assert dry == real and dry.startswith("weft: error: compile.enable = True: parallelize: compile with tensor")
    assert len(dry.strip().splitlines()) == 1


# Plans every shipped config in one fresh process: the seconds each takes, and the process's peak RSS.
PLAN_EACH = """
import json, resource, sys, time
from weft import train
seconds = {}
for config, world_size in json.loads(sys.argv[1]).items():
    start = time.monotonic()
    code = train.main(["--job.config_file", config, "--job.dry_run", "--job.dry_run_world_size", str(world_size)])
    assert code == 0, config
    seconds[config] = time.monotonic() - start
print(json.dumps({"seconds": seconds, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}))
"""


@pytest.mark.slow
def test_every_shipped_config_passes_its_dry_run_in_a_minute_and_a_few_gb():
    """Every shipped config passes the dry run in the layout its comments document (the dry run
    applies the real start's transforms and refusals, compile included, so it starts there as far
    as its layout goes), each within a minute, in one fresh process (one each cost a minute more of
    the suite) never resident above 4 GiB. Two such processes, each planning half the configs, run
    at the same time (the dry run is one core's work)."""
    assert set(SHIPPED) == {path.stem for path in (REPO / "train_configs").glob("*.toml")}
    configs = sorted(SHIPPED)
    halves = [{c: SHIPPED[c] for c in configs[i::2]} for i in range(2)]
    runs = [subprocess.Popen([sys.executable, "-c", PLAN_EACH, json.dumps(half)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for half in halves]
    seconds = {}
    for run in runs:
        stdout, stderr = run.communicate()
        assert run.returncode == 0, stderr[-3000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        seconds |= result["seconds"]
        assert result["rss_gib"] < 4, f"{result['rss_gib']:.1f} GiB resident"
    assert set(seconds) == set(SHIPPED)
    slow = {config: round(s) for config, s in seconds.items() if s >= 60}
    assert not slow, f"over a minute: {slow}"


def test_muon_dry_run_counts_one_momentum_per_matrix_element_and_its_gathered_matrix(tmp_path):
    from weft.recipe.dry_run import dry_run

    def estimate(*extra: str):
        return dry_run(parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "out"),
                                   "--job.dry_run", *extra]))

    adamw, muon = estimate(), estimate("--optimizer.name", "Muon")
    args = flavors()["debugmodel"]
    hidden = (2 * args.dim * args.n_heads * (args.dim // args.n_heads)
              + 2 * args.dim * args.n_kv_heads * (args.dim // args.n_heads))  # wq, wo, wk, wv
    hidden += 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    assert adamw.optimizer - muon.optimizer == 4 * hidden * args.n_layers  # one fp32 buffer fewer each
    assert muon.buffers["Muon: 1 matrix gathered whole, Newton-Schulz"] == args.dim * args.ffn_hidden_dim * 14
    assert "Muon 1 x fp32" in muon.table()
