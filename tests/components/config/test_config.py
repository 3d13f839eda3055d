"""Tests for components.config: layering, parsing forms, errors, --help and the TOML round trip."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from weft.components.config import ConfigError, JobConfig, Training, help_text, parse_args, to_dict, to_toml
from weft.components.config import parser as config


def write_toml(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(argv: list[str]) -> str:
    """The message of the ConfigError that ``parse_args(argv)`` raises, checked to be one line."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- layering ----

def test_defaults():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 1000
    assert cfg.parallelism.dp_shard == -1
    assert cfg.optimizer.lr == 3e-4
    assert cfg.float8.filter_fqns == ["output"]
    assert cfg.metrics.enable_tensorboard is True


def test_list_defaults_are_not_shared():
    first, second = JobConfig(), JobConfig()
    first.float8.filter_fqns.append("layers.0")
    assert second.float8.filter_fqns == ["output"]


def test_toml_overrides_defaults(tmp_path):
    path = write_toml(tmp_path, """
        [training]
        steps = 10
        max_norm = 2          # an int is accepted for a float
        [float8]
        enable = true
        filter_fqns = ["output", "layers.0"]
        [metrics]
        enable_tensorboard = false
    """)
    cfg = parse_args(["--job.config_file", path])
    assert cfg.training.steps == 10
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.float8.filter_fqns == ["output", "layers.0"]
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.training.seq_len == 2048
    assert cfg.job.config_file == path


def test_command_line_overrides_toml_wherever_config_file_appears(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 10\nseed = 3\n")
    for argv in (["--job.config_file", path, "--training.steps", "20"],
                 ["--training.steps", "20", "--job.config_file", path]):
        cfg = parse_args(argv)
        assert (cfg.training.steps, cfg.training.seed) == (20, 3)


def test_last_occurrence_wins():
    assert parse_args(["--training.steps", "5", "--training.steps=6"]).training.steps == 6


def test_bare_name_is_found_in_train_configs(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "TRAIN_CONFIGS_DIR", tmp_path)
    write_toml(tmp_path, "[model]\nflavor = \"llama3_8b\"\n", name="llama3_8b.toml")
    monkeypatch.chdir(tmp_path.parent)  # so the bare name is not a file in the current folder
    assert parse_args(["--job.config_file", "llama3_8b"]).model.flavor == "llama3_8b"
    assert parse_args(["--job.config_file", "llama3_8b.toml"]).model.flavor == "llama3_8b"


# ---- command-line forms ----

def test_space_and_equals_forms():
    for argv in (["--training.steps", "7", "--data.text_field", "body"],
                 ["--training.steps=7", "--data.text_field=body"]):
        cfg = parse_args(argv)
        assert (cfg.training.steps, cfg.data.text_field) == (7, "body")


def test_value_may_contain_equals_and_negative_numbers():
    cfg = parse_args(["--job.description=a=b", "--parallelism.dp_shard", "-1", "--checkpoint.load_step", "-1"])
    assert cfg.job.description == "a=b"
    assert cfg.parallelism.dp_shard == -1


def test_numbers():
    cfg = parse_args(["--optimizer.lr", "3e-4", "--training.max_norm", "2", "--lr_scheduler.min_lr_ratio=0.1"])
    assert cfg.optimizer.lr == 3e-4
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.lr_scheduler.min_lr_ratio == 0.1


@pytest.mark.parametrize(("argv", "expected"), [
    (["--training.deterministic"], True),
    (["--training.deterministic=true"], True),
    (["--training.deterministic=False"], False),
    (["--training.deterministic", "false"], False),
    (["--training.deterministic", "TRUE"], True),
    (["--training.deterministic", "1"], True),
    (["--training.deterministic", "0"], False),
    (["--training.deterministic", "yes"], True),
    (["--training.deterministic", "No"], False),
    (["--training.deterministic=yes"], True),
    (["--no-training.deterministic"], False),
    (["--training.deterministic", "--no-training.deterministic"], False),
])
def test_boolean_forms(argv, expected):
    assert parse_args(argv).training.deterministic is expected


def test_flag_alone_does_not_swallow_the_next_option():
    cfg = parse_args(["--compile.enable", "--training.steps", "3"])
    assert cfg.compile.enable is True and cfg.training.steps == 3


def test_no_form_disables_a_true_default():
    assert parse_args(["--no-metrics.enable_tensorboard"]).metrics.enable_tensorboard is False


@pytest.mark.parametrize(("text", "expected"), [
    ("output,layers.0", ["output", "layers.0"]),
    ("output", ["output"]),
    (" a , b ,", ["a", "b"]),
    ("", []),
])
def test_list_parsing(text, expected):
    assert parse_args(["--float8.enable", "--float8.filter_fqns", text]).float8.filter_fqns == expected
    assert parse_args(["--float8.enable", f"--float8.filter_fqns={text}"]).float8.filter_fqns == expected


def test_selective_option_accepts_op_or_positive_integer():
    assert parse_args(["--activation_checkpoint.selective_option", "2"]).activation_checkpoint.selective_option == "2"
    assert parse_args(["--activation_checkpoint.selective_option=op"]).activation_checkpoint.selective_option == "op"


def test_argv_none_reads_sys_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "--training.steps", "4"])
    assert parse_args().training.steps == 4


# ---- errors ----

def test_unknown_option_suggests_the_closest():
    message = config_error(["--training.stpes", "10"])
    assert message == "unknown option --training.stpes; did you mean --training.steps?"


def test_unknown_option_suggests_the_section_that_has_the_key():
    assert "did you mean --optimizer.lr?" in config_error(["--training.lr=1"])


def test_unknown_option_without_a_match():
    message = config_error(["--zzz"])
    assert "--zzz" in message and "--help" in message


def test_wrong_type_on_command_line():
    assert config_error(["--training.steps", "ten"]) == "--training.steps: expected an integer, got 'ten'"
    assert "'1.5'" in config_error(["--training.steps=1.5"])
    assert "expected a number" in config_error(["--optimizer.lr", "fast"])
    assert "expected a boolean, got 'maybe'" in config_error(["--training.deterministic=maybe"])


def test_out_of_range():
    assert config_error(["--training.steps", "0"]) == "--training.steps: must be >= 1, got 0"
    assert config_error(["--optimizer.lr", "0"]) == "--optimizer.lr: must be > 0, got 0.0"
    assert config_error(["--optimizer.beta2", "1"]) == "--optimizer.beta2: must be < 1, got 1.0"
    message = config_error(["--lr_scheduler.min_lr_ratio", "1.5"])
    assert message == "--lr_scheduler.min_lr_ratio: must be <= 1, got 1.5"
    assert config_error(["--parallelism.dp_shard", "0"]) == "--parallelism.dp_shard: must be -1 or >= 1, got 0"
    message = config_error(["--activation_checkpoint.selective_option", "0"])
    assert message == "--activation_checkpoint.selective_option: must be 'op' or a positive integer, got '0'"


def test_bad_choice():
    message = config_error(["--activation_checkpoint.mode", "fulll"])
    assert message == ("--activation_checkpoint.mode: expected one of none, full, selective; got 'fulll' "
                       "(did you mean full?)")
    assert "llama3_8b" in config_error(["--model.flavor=llama9"])


def test_unknown_pipeline_schedule_suggests_the_closest():
    from torch.distributed.pipelining.schedules import get_schedule_class

    from weft.components.config.schema import PIPELINE_SCHEDULES

    message = config_error(["--parallelism.pp_schedule", "interleaved1f1b"])
    assert message.endswith("got 'interleaved1f1b' (did you mean Interleaved1F1B?)")
    assert config_error(["--parallelism.pp_schedule", "1f1bb"]).endswith("(did you mean 1F1B?)")
    assert config_error(["--parallelism.pp_schedule", "zbv"]).endswith("(did you mean ZBVZeroBubble?)")
    assert config_error(["--parallelism.pp_schedule", "xyz"]).endswith("got 'xyz'")
    # Every name offered is one torch resolves to a schedule class.
    assert all(get_schedule_class(name).__name__.startswith("Schedule") for name in PIPELINE_SCHEDULES)


def test_missing_value():
    assert config_error(["--training.steps"]) == "--training.steps: missing value, expected an integer"
    assert "--job.dump_folder: missing value" in config_error(["--job.dump_folder", "--training.steps", "1"])


def test_positional_argument():
    message = config_error(["llama3_8b.toml"])
    assert "unexpected argument 'llama3_8b.toml'" in message


def test_no_form_of_a_non_boolean():
    assert "only boolean options" in config_error(["--no-training.steps"])
    assert "takes no value" in config_error(["--no-compile.enable=true"])


def test_config_file_not_found(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "TRAIN_CONFIGS_DIR", tmp_path)
    message = config_error(["--job.config_file", "nope.toml"])
    assert message == f"job.config_file: 'nope.toml' not found (looked in the current folder and {tmp_path})"


def test_toml_syntax_error(tmp_path):
    message = config_error(["--job.config_file", write_toml(tmp_path, "[training\nsteps = 1\n", name="bad.toml")])
    assert message.startswith("bad.toml: invalid TOML: ") and "line 1" in message


def test_toml_unknown_section(tmp_path):
    path = write_toml(tmp_path, "[trainng]\nsteps = 1\n", name="llama8b.toml")
    message = config_error(["--job.config_file", path])
    assert message == "unknown section [trainng] in llama8b.toml; did you mean [training]?"


def test_toml_top_level_key_is_rejected(tmp_path):
    path = write_toml(tmp_path, "training = 3\n", name="x.toml")
    assert config_error(["--job.config_file", path]) == "training in x.toml: expected a [training] table, got 3"


def test_toml_unknown_key(tmp_path):
    path = write_toml(tmp_path, "[training]\nstpes = 1\n", name="x.toml")
    message = config_error(["--job.config_file", path])
    assert message == "unknown key training.stpes in x.toml; did you mean training.steps?"


@pytest.mark.parametrize(("line", "expected"), [
    ('steps = "ten"', 'training.steps in x.toml: expected an integer, got "ten" (str)'),
    ("steps = true", "training.steps in x.toml: expected an integer, got true (bool)"),
    ("steps = 1.5", "training.steps in x.toml: expected an integer, got 1.5 (float)"),
    ("deterministic = 1", "training.deterministic in x.toml: expected a boolean, got 1 (int)"),
    ("max_norm = false", "training.max_norm in x.toml: expected a number, got false (bool)"),
    ('seed = "0"', 'training.seed in x.toml: expected an integer, got "0" (str)'),
])
def test_toml_wrong_type(tmp_path, line, expected):
    path = write_toml(tmp_path, f"[training]\n{line}\n", name="x.toml")
    assert config_error(["--job.config_file", path]) == expected


def test_toml_wrong_list(tmp_path):
    path = write_toml(tmp_path, "[float8]\nfilter_fqns = [1, 2]\n", name="x.toml")
    assert config_error(["--job.config_file", path]) == (
        "float8.filter_fqns in x.toml: expected a list of strings, got [1, 2] (list)")


def test_toml_values_are_validated(tmp_path):
    path = write_toml(tmp_path, '[activation_checkpoint]\nmode = "fulll"\n', name="x.toml")
    assert config_error(["--job.config_file", path]) == (
        'activation_checkpoint.mode in x.toml: expected one of none, full, selective; got "fulll" '
        '(did you mean full?)')


def test_command_line_can_fix_a_bad_toml_value(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 0\n")
    assert parse_args(["--job.config_file", path, "--training.steps", "5"]).training.steps == 5


def test_defaults_are_validated(monkeypatch):
    monkeypatch.setattr(config, "JobConfig", lambda: JobConfig(training=Training(steps=0)))
    assert config_error([]) == "training.steps (default): must be >= 1, got 0"


# ---- --help ----

def test_help_exits_zero_and_prints_help(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--training.steps", "3", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out == help_text() + "\n"


def test_help_lists_every_field_with_its_default():
    text = help_text()
    for section, values in to_dict(JobConfig()).items():
        assert f"[{section}]" in text
        for key, default in values.items():
            line = next(line for line in text.splitlines() if line.startswith(f"  --{section}.{key} "))
            assert f"default {config.toml_value(default)}" in line
    assert "one of none, full, selective" in text


# ---- to_dict / to_toml ----

def test_to_dict():
    data = to_dict(parse_args(["--training.steps", "5"]))
    assert list(data) == [f.name for f in fields(JobConfig)]
    assert data["training"]["steps"] == 5
    assert data["float8"]["filter_fqns"] == ["output"]


def test_to_toml_round_trip(tmp_path):
    cfg = parse_args([
        "--training.steps", "5", "--optimizer.lr", "1e-5", "--no-metrics.enable_tensorboard",
        "--float8.enable", "--float8.filter_fqns", "output,layers.0", "--job.description", 'tricky "quotes" \\ tab\t and\nnewline é',
        "--training.max_norm", "0", "--optimizer.eps", "1e-12",
    ])
    path = write_toml(tmp_path, to_toml(cfg), name="dumped.toml")
    reloaded = parse_args(["--job.config_file", path])
    reloaded.job.config_file = cfg.job.config_file
    assert reloaded == cfg


def test_to_toml_round_trip_of_defaults(tmp_path):
    path = write_toml(tmp_path, to_toml(JobConfig()), name="defaults.toml")
    reloaded = parse_args(["--job.config_file", path])
    reloaded.job.config_file = ""
    assert reloaded == JobConfig()


def test_sft_options():
    cfg = parse_args(["--data.format", "chat", "--data.document_masking", "--validation.enable",
                      "--validation.dataset_path", "val.jsonl", "--validation.freq", "5"])
    assert (cfg.data.format, cfg.data.document_masking, cfg.validation.freq) == ("chat", True, 5)
    assert cfg.validation.format == "" and cfg.data.long_samples == "truncate"
    with pytest.raises(ConfigError, match="--validation.format: expected one of '', text, chat, prompt_completion"):
        parse_args(["--validation.format", "alpaca"])


# ---- sections with an enable switch ----

@pytest.mark.parametrize("argv, key", [
    (["--validation.dataset_path", "val.jsonl"], "--validation.dataset_path = 'val.jsonl'"),
    (["--checkpoint.interval", "10"], "--checkpoint.interval = 10"),
    (["--float8.recipe", "rowwise"], "--float8.recipe = 'rowwise'"),
])
def test_a_key_of_a_disabled_section_names_the_switch(argv, key):
    """Every section with `enable` follows one rule: a key changed while the section is off would
    be ignored, so it is an error naming the key and the switch; enabling the section accepts it."""
    section = argv[0][2:].split(".")[0]
    with pytest.raises(ConfigError, match=f"^{re.escape(key)} has no effect while {section}.enable is false; "
                                          f"set {section}.enable = true"):
        parse_args(argv)
    assert parse_args([*argv, f"--{section}.enable"]) != JobConfig()


def test_a_disabled_section_in_toml_is_named_with_its_file(tmp_path):
    path = write_toml(tmp_path, """
        [validation]
        dataset_path = "val.jsonl"
    """)
    with pytest.raises(ConfigError, match=r"^validation.dataset_path in job.toml = \"val.jsonl\" has no effect"):
        parse_args(["--job.config_file", path])
    # a key equal to its default changes nothing, and keys that act on their own are exempt
    assert parse_args(["--checkpoint.interval", "500", "--checkpoint.initial_load_path", "x"]).checkpoint.interval == 500
    # a switch turned off on purpose keeps its section's settings dormant (a config with
    # checkpoints, run once without them)
    path = write_toml(tmp_path, """
        [checkpoint]
        enable = true
        interval = 10
    """)
    assert parse_args(["--job.config_file", path, "--no-checkpoint.enable"]).checkpoint.interval == 10


# ---- [sampling] ----

def test_sampling_section_reads_every_key_from_toml(tmp_path):
    path = write_toml(tmp_path, """
        [sampling]
        max_completion_length = 64
        temperature = 0
        top_p = 0.9
        top_k = 50
        min_p = 0.05
        seed = 7
        stop = ["\\n\\n", "THE END"]
    """)
    sampling = parse_args(["--job.config_file", path]).sampling
    assert (sampling.max_completion_length, sampling.temperature, sampling.top_p, sampling.top_k) == (64, 0.0, 0.9, 50)
    assert (sampling.min_p, sampling.seed, sampling.stop) == (0.05, 7, ["\n\n", "THE END"])


@pytest.mark.parametrize("argv, expected", [
    (["--sampling.max_completion_length", "0"], "--sampling.max_completion_length: must be >= 1, got 0"),
    (["--sampling.temperature", "-1"], "--sampling.temperature: must be >= 0, got -1.0"),
    (["--sampling.top_p", "0"], "--sampling.top_p: must be > 0, got 0.0"),
    (["--sampling.top_p", "1.5"], "--sampling.top_p: must be <= 1, got 1.5"),
    (["--sampling.top_k", "-1"], "--sampling.top_k: must be >= 0, got -1"),
    (["--sampling.min_p", "1.01"], "--sampling.min_p: must be <= 1, got 1.01"),
    (["--sampling.seed", "-3"], "--sampling.seed: must be >= 0, got -3"),
])
def test_sampling_bounds(argv, expected):
    assert config_error(argv) == expected


def test_an_empty_stop_string_is_refused(tmp_path):
    path = write_toml(tmp_path, '[sampling]\nstop = ["END", ""]\n', name="x.toml")
    assert config_error(["--job.config_file", path]) == (
        'sampling.stop in x.toml: must be a list of non-empty strings, got ["END", ""]')
