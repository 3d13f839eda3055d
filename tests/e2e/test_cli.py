"""The `weft` command (cli.py): each subcommand reaches its entry point, and every usage mistake,
of the command or of a subcommand, is one line `weft: error: ...` with exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weft.cli import main
from weft.components.config import help_text
from weft.errors import PREFIX

from tests.support import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# An option only that command's own parser has.
OWN_OPTION = {"generate": "--max-new-tokens", "export": "--max-shard-gb", "export-lora": "--peft-out",
              "prepare": "--shard-bytes"}


def status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("command", sorted(OWN_OPTION))
def test_a_subcommand_is_its_entry_point_under_its_own_name(command, capsys):
    assert status([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: weft {command} ") and OWN_OPTION[command] in out


def test_export_lora_is_an_alias_of_export(capsys):
    assert status(["export-lora", "--help"]) == 0
    alias = " ".join(capsys.readouterr().out.split())
    assert status(["export", "--help"]) == 0
    assert "`weft export-lora` is an alias of `weft export`." in alias
    assert alias.replace("weft export-lora", "weft export").replace(" `weft export` is an alias of `weft export`.", "") \
        == " ".join(capsys.readouterr().out.split())


def test_train_is_train_py(capsys):
    assert status(["train", "--help"]) == 0
    assert capsys.readouterr().out == help_text() + "\n"


@pytest.mark.parametrize("argv", [[], ["trian"], ["train", "--training.stpes", "3"], ["generate", "--top-k", "x"],
                                  ["export", "--checkpoint", "c"], ["export-lora", "--nope"], ["prepare", "--out", "o"]])
def test_a_usage_mistake_is_one_line_and_exit_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert status(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_python_dash_m_weft_is_the_command():
    run = subprocess.run([sys.executable, "-m", "weft", "trian"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith(f"{PREFIX}argument command: invalid choice: 'trian'")
    assert run.stderr.count("\n") == 1
