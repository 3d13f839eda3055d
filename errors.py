"""How weft's commands report a user's mistake: one line `weft: error: ...` on stderr, exit 2.

Every mistake a user can fix derives from `UserError`: each entry point (the `weft` command's
train, generate, export, export-lora and prepare) catches that one class and ends through
`report_user_error`, so a user (and a script) sees the same shape whatever command failed, and
never a traceback. A command-line mistake ends the same way, through `OneLineParser`.
The subclasses stay where their checks live (ConfigError in components/config, DataError in
the data package, LayoutError beside the mesh, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule

PREFIX = "weft: error: "
EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A mistake the user can fix (a config value, a data file, a checkpoint, a layout); its
    message is one line naming the key or file, the value and what was expected."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line `weft: error: ...`, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{PREFIX}{one_line(message)}\n")


@dataclass(frozen=True)
class Conflict:
    """The other transform's argument behind a refusal to compose: `label` names what it turned on
    (QLoRA), `argument` None the transform as a whole."""

    label: str
    function: str
    argument: str | None = None
    value: object = None

    def __str__(self) -> str:
        return self.function if self.argument is None else f"{self.function}'s {self.argument} = {self.value!r}"


class TransformError(UserError):
    """A transform cannot apply to this model with these arguments.

    `function` and `argument` name what the caller passed (`apply_tp`, `tp_mesh`; argument None:
    the transform as a whole), so a caller that built those arguments from its own settings can say
    which setting is at fault. `conflict`: the other transform this one cannot compose with.
    """

    def __init__(self, function: str, argument: str | None, message: str, conflict: Conflict | None = None):
        super().__init__(f"{function}: {message}" if conflict is None else
                         f"{function}: {conflict.label} ({conflict}) {message}")
        self.function = function
        self.argument = argument
        self.reason = message
        self.conflict = conflict


def one_line(message: object) -> str:
    """`message` as a single line: embedded newlines (from a wrapped library message) become ' | '."""
    return " | ".join(part.strip() for part in str(message).splitlines() if part.strip())


def report_user_error(error: object) -> int:
    """Print `weft: error: <error>` as one line and return the exit status for user errors (2).

    One write, newline included: under torchrun every rank reports at once into one stream, and
    separate writes of message and newline (unbuffered stderr) would interleave.
    """
    line = f"{PREFIX}{one_line(error)}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    _record_for_torchrun(line)
    return EXIT_USER_ERROR


def _record_for_torchrun(line: str) -> None:
    """Under torchrun, also leave the line in the error file torchrun gives each worker
    (TORCHELASTIC_ERROR_FILE): torchrun's closing failure report then shows it as the root
    cause, where it would otherwise say "To enable traceback see: ...". torchrun still prints
    its own ChildFailedError traceback above that report; a worker cannot prevent it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line is on stderr already; the report is a nicety


def refuse_data_parallel_model(model: nn.Module, function: str) -> None:
    """Raise if FSDP or DDP (`fully_shard` / `replicate`) already wrapped any part of the model.

    Data parallelism must come last: it shards or replicates the parameters that exist when it
    runs, so a transform that swaps modules or parameters afterwards would escape it.
    """
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):  # fully_shard, and replicate (a subclass)
            where = f" ({name})" if name else ""
            raise TransformError(
                function,
                "model",
                f"the model is already wrapped by FSDP/DDP{where}; apply {function} before apply_fsdp / "
                "apply_ddp (order: float8, tp, cp, ac, compile, fsdp/ddp)",
            )
