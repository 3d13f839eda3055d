"""The `weft` command: `weft <command> [options]` runs one of weft's entry points, from any folder.

    weft train        train.py: --job.config_file NAME also finds a shipped config (debug_model, ...)
    weft generate     generate.py: sample from a checkpoint or a Hugging Face folder
    weft export       a checkpoint to a Hugging Face folder; a LoRA run's merged and/or as PEFT (python -m weft.recipe.export)
    weft export-lora  an alias of weft export
    weft prepare      a corpus to token shards (python -m weft.components.data.prepare)

`weft <command> --help` lists its options. Under torchrun: `torchrun ... -m weft train ...`.
"""

from __future__ import annotations

import argparse
import sys

from weft.components.data.prepare import main as prepare
from weft.errors import OneLineParser
from weft.generate import main as generate
from weft.recipe.export import main as export
from weft.train import main as train

COMMANDS = ("train", "generate", "export", "export-lora", "prepare")


def main(argv: list[str] | None = None) -> int:
    """Run `weft <command> ...`; its exit status (2 for a user's mistake)."""
    args = sys.argv[1:] if argv is None else list(argv)
    parser = OneLineParser(prog="weft", description=__doc__.split("\n\n")[0],
                           epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=COMMANDS, metavar="command", help=", ".join(COMMANDS))
    command = parser.parse_args(args[:1]).command
    rest, prog = args[1:], f"weft {command}"
    # Each command imports only its own module: `weft prepare` need not import torch's distributed stack.
    if command == "train":
        return train(rest)
    if command == "generate":
        return generate(rest, prog=prog)
    if command in ("export", "export-lora"):
        return export(rest, prog=prog)
    return prepare(rest, prog=prog)
