"""recipe/plan.py: the plan resolves the config without side effects and names the key behind a refusal."""

from __future__ import annotations

import pytest
import torch

from weft.components.config import ConfigError, parse_args
from weft.float8 import Float8Options
from weft.models.llama import LLAMA_FLAVORS
from weft.parallelisms.ac import ACOptions
from weft.parallelisms.common import TransformError
from weft.parallelisms.compile import CompileOptions
from weft.parallelisms.fsdp import FSDPOptions
from weft.parallelisms.lora import LoRAOptions
from weft.parallelisms.pipeline import PipelineOptions
from weft.parallelisms.tp import TPOptions
from weft.recipe.config_keys import (
    ARGUMENT_KEYS,
    OPTION_SECTIONS,
    TRANSFORM_KEYS,
    config_error,
    config_value,
    option_key,
)
from weft.recipe.plan import RunPlan


def plan_for(*overrides: str, world_size: int = 1, **kwargs) -> RunPlan:
    cfg = parse_args(["--job.config_file", "debug_model", "--job.dump_folder", "/nonexistent/weft-plan", *overrides])
    return RunPlan.from_config(cfg, world_size, device_type="cpu", **kwargs)


def test_plan_resolves_the_layout_batch_and_precision():
    plan = plan_for("--parallelism.tp", "2", "--training.local_batch_size", "3", "--training.seq_len", "64",
                    "--training.gradient_accumulation_steps", "2", "--training.mixed_precision_param", "bfloat16",
                    world_size=8, check_environment=False)
    dims = plan.dims
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (1, 4, 1, 2)
    assert plan.tokens_per_step == 64 * 3 * 2 * 4  # seq x local batch x accumulation x dp ranks
    assert plan.model_args == LLAMA_FLAVORS["debugmodel"]
    assert plan.precision.compute_dtype == torch.bfloat16  # FSDP's param dtype from the config


def test_every_option_of_parallelize_names_its_config_key():
    """Every field of parallelize's options is an argument the plan maps to a config key that
    exists (a renamed field or key fails here), so any refusal of an argument names its key."""
    import dataclasses

    plan = plan_for(check_environment=False)
    accepted = set(ARGUMENT_KEYS)
    options = [LoRAOptions, Float8Options, TPOptions, ACOptions, CompileOptions, FSDPOptions, PipelineOptions]
    assert {f.name for part in options for f in dataclasses.fields(part)} <= accepted
    assert {f.name for f in dataclasses.fields(plan.options)} == {"lora", "float8", "tp", "ac", "compile", "fsdp",
                                                                   "pipeline"}
    for key in [*ARGUMENT_KEYS.values(), *TRANSFORM_KEYS.values()]:
        config_value(plan.cfg, key)  # an AttributeError names a key the config does not have


def test_the_options_read_from_the_config_are_those_written_out_by_hand():
    """read_options builds each option from its section by field name: the same options as spelled
    out key by key, dtypes from their names, empty values as None, lists of tuple fields as tuples."""
    plan = plan_for("--lora.enable", "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "wq,wv",
                    "--lora.use_rslora", "--training.mixed_precision_param", "bfloat16",
                    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option", "2",
                    "--compile.enable", "--parallelism.fsdp_reshard_after_forward", "never",
                    "--parallelism.pp", "2", "--parallelism.pp_schedule", "GPipe", world_size=2,
                    check_environment=False)
    assert plan.options.lora == LoRAOptions(rank=4, alpha=8.0, target_modules=["wq", "wv"], use_rslora=True,
                                            base_dtype=torch.bfloat16)
    assert plan.options.ac == ACOptions(mode="selective", selective_option="2")
    assert plan.options.compile == CompileOptions()
    assert plan.options.fsdp == FSDPOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                            reshard_after_forward="never")
    assert plan.options.tp == TPOptions(loss_parallel=True) and plan.options.pipeline == PipelineOptions("GPipe")
    assert plan.options.float8 is None
    float8 = plan_for("--float8.enable", "--float8.filter_fqns", "output,w2", "--float8.min_dim", "16",
                      check_environment=False).options
    assert float8.float8 == Float8Options(filter_fqns=("output", "w2"), min_dim=16) and float8.lora is None
    assert plan_for("--lora.enable", check_environment=False).options.lora == LoRAOptions(base_dtype=torch.float32)


def test_an_argument_names_one_config_key_whatever_option_holds_it():
    """ARGUMENT_KEYS is by argument name: two options' fields of one name would have to share a key."""
    import dataclasses

    keys = {}
    for options in OPTION_SECTIONS:
        for f in dataclasses.fields(options):
            keys.setdefault(f.name, set()).add(option_key(options, f.name))
    assert all(len(found) == 1 for found in keys.values()), keys


@pytest.mark.parametrize("argument, expected", [
    ("tp_mesh", "parallelism.tp = 3: apply_tp: refused"),
    ("mode", "activation_checkpoint.mode = none: apply_ac: refused"),
    ("selective_option", "activation_checkpoint.selective_option = op: apply_ac: refused"),
    ("reshard_after_forward", "parallelism.fsdp_reshard_after_forward = default: apply_ac: refused"),
    ("compile", "compile.enable = False: apply_ac: refused"),
])
def test_a_transform_refusal_names_the_config_key_it_came_from(argument, expected):
    plan = plan_for("--parallelism.tp", "3", "--training.seq_len", "96", world_size=3, check_environment=False)
    function = "apply_tp" if argument == "tp_mesh" else "apply_ac"
    error = config_error(plan.cfg, TransformError(function, argument, "refused"))
    assert isinstance(error, ConfigError) and str(error) == expected


def test_environment_checks_are_skipped_only_when_asked(tmp_path):
    missing = str(tmp_path / "no-such-data")
    plan = plan_for("--data.dataset_path", missing, check_environment=False)  # the dry run plans without files
    assert plan.data_files == [] and plan.tokenizer is None
    with pytest.raises(Exception, match=f"data.dataset_path: no file or folder at '{missing}'"):
        plan_for("--data.dataset_path", missing)


def test_validation_files_errors_name_the_validation_key(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(Exception, match=f"^validation.dataset_path: no file or folder at '{missing}'$"):
        plan_for("--validation.enable", "--validation.dataset_path", missing)


def test_cpu_offload_needs_fsdp_and_gpu_float8_needs_its_shapes():
    """Checked by the plan, so a dry run for GPUs refuses them too: offload without FSDP would
    silently offload nothing, and CUDA's float8 kernels refuse these dtypes and token counts."""
    offload = parse_args(["--job.config_file", "debug_model", "--parallelism.fsdp_cpu_offload"])
    with pytest.raises(ConfigError, match=r"^parallelism.fsdp_cpu_offload: offloads FSDP's shards, and this layout "):
        RunPlan.from_config(offload, 1, device_type="cuda", check_environment=False)
    assert RunPlan.from_config(offload, 2, device_type="cuda", check_environment=False).dims.fsdp_enabled
    with pytest.raises(ConfigError, match="^parallelism.fsdp_cpu_offload: moves GPU memory to the CPU, and this run "
                                          "has no GPU$"):  # (FSDP would fail pinning the shards on a CPU machine)
        RunPlan.from_config(offload, 2, device_type="cpu", check_environment=False)
    gpu = parse_args(["--job.config_file", "debug_model", "--float8.enable", "--float8.recipe", "rowwise"])
    with pytest.raises(ConfigError, match="^float8.recipe = rowwise: needs bf16 compute on a GPU"):
        RunPlan.from_config(gpu, 1, device_type="cuda", check_environment=False)
    assert RunPlan.from_config(gpu, 1, device_type="cpu", check_environment=False).dims.world_size == 1
    warnings = RunPlan.from_config(parse_args(["--job.config_file", "debug_model"]), 1, device_type="cuda",
                                   check_environment=False).warnings
    assert [w.split(":")[0] for w in warnings] == ["training.mixed_precision_param = float32 with grouped-query attention"]


def test_a_plan_that_writes_no_outputs_ignores_the_dump_folder(tmp_path):
    """A measurement's plan (writes_dump_folder=False) neither checks nor touches job.dump_folder:
    a folder holding another run (seq_len 128, as the quickstart leaves outputs/debug_model)
    refuses a run's plan and not a measurement's, and stays as it was."""
    from weft.components.config import to_toml

    dump = tmp_path / "debug_model"
    dump.mkdir()
    (dump / "config.toml").write_text(to_toml(parse_args(["--job.config_file", "debug_model",
                                                          "--training.seq_len", "128"])))
    before = sorted(p.name for p in dump.iterdir())
    cfg = parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.seq_len", "64"])
    with pytest.raises(ConfigError, match="training.seq_len = 128, this run has 64"):
        RunPlan.from_config(cfg, 1, device_type="cpu")
    assert RunPlan.from_config(cfg, 1, device_type="cpu", writes_dump_folder=False).cfg.training.seq_len == 64
    assert sorted(p.name for p in dump.iterdir()) == before


def test_float8_auto_filter_reaches_apply_float8():
    """float8.auto_filter (issue 40's candidate) is off unless asked, and the plan passes it on."""
    off = plan_for("--float8.enable", "--float8.min_dim", "16", check_environment=False)
    on = plan_for("--float8.enable", "--float8.auto_filter", check_environment=False)
    assert off.options.float8.auto_filter is False and on.options.float8.auto_filter is True
