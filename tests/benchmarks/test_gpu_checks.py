"""benchmarks/gpu_checks.sh's groups for the GPU checks still to run (issues 37, 38, 40, 49, 58): every
command each prints (PRINT=1: no GPU, nothing run) parses with the script or train.py it calls, so
that a lent GPU's few minutes are not lost to a misspelt option or row name."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from benchmarks import generation, gpt_oss, gpu_throughput, hf_backend, lora, moe, preference, rl_step
from weft.components.config import ConfigError, parse_args

from tests.support import REPO

GROUPS = ("perf", "perf_ab", "moe_block", "qwen3", "qlora_moe", "newer", "generation")


def printed_commands(group: str, tmp_path) -> list[list[str]]:
    """The group's commands, printed. A python3 that only fails comes first on PATH: were PRINT ever
    ignored, the script could neither install nor run anything here."""
    stub = tmp_path / "python3"
    stub.write_text("#!/bin/sh\nexit 97\n")
    stub.chmod(0o755)
    env = {**os.environ, "PRINT": "1", "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(["bash", "benchmarks/gpu_checks.sh", group], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def check_parses(command: list[str]) -> None:
    """Parse `command`'s arguments as the script it runs would (SystemExit on a bad one)."""
    assert command[0] == "python3", command
    script, args = command[1], command[2:]
    train_args = args[args.index("--") + 1:] if "--" in args else []
    if script == "train.py":
        parse_args(args)
    elif script == "benchmarks/gpu_throughput.py":
        gpu_throughput.parse_args(args)
    elif script == "benchmarks/moe.py":
        moe.parse_args(args)
    elif script == "benchmarks/lora.py":
        opts = lora.parse_cli(args)
        for mode in opts.modes:  # lora.py lays its modes' options over debug_model.toml and these
            parse_args(["--job.config_file", "debug_model", *train_args, *lora.MODES[mode]])
    elif script in ("benchmarks/hf_backend.py", "benchmarks/preference.py", "benchmarks/gpt_oss.py"):
        {"hf_backend": hf_backend, "preference": preference, "gpt_oss": gpt_oss}[script[11:-3]].parse_cli(args)
    elif script == "benchmarks/generation.py":
        generation.parse_cli(args)
    elif script == "benchmarks/rl_step.py":
        opts = rl_step.parse_cli(args)
        for flavor in opts.flavors:  # rl_step.py lays these over debug_grpo.toml
            parse_args(["--job.config_file", "debug_grpo", "--model.flavor", flavor, *shlex.split(opts.device_args)])
    elif script == "benchmarks/memory_check.py":
        parse_args(train_args)
    else:
        raise AssertionError(f"no parser known for {script}")


@pytest.mark.parametrize("group", GROUPS)
def test_every_command_of_the_group_parses(group, tmp_path):
    commands = printed_commands(group, tmp_path)
    assert commands, group
    for command in commands:
        check_parses(command)


def test_a_misspelt_option_is_caught():
    with pytest.raises(SystemExit):
        check_parses(["python3", "benchmarks/gpu_throughput.py", "--configs", "float8_rowwise_compile+output"])
    with pytest.raises(ConfigError, match="--training.stepz"):
        check_parses(["python3", "benchmarks/memory_check.py", "--layers", "2", "--", "--training.stepz", "4"])
