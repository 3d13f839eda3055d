"""How weft's commands report a user's mistake: one line `weft: error: ...` on stderr, exit 2.

train.py, generate.py and `python -m components.hf export` all end through `report_user_error`,
so a user (and a script) sees the same shape whatever command failed, and never a traceback
for something they can fix. The error classes stay where their checks live (ConfigError in
config.py, DataError in data.py, ...); this module only knows how to print them.
"""

from __future__ import annotations

import sys

PREFIX = "weft: error: "
EXIT_USER_ERROR = 2


def one_line(message: object) -> str:
    """`message` as a single line: embedded newlines (from a wrapped library message) become ' | '."""
    return " | ".join(part.strip() for part in str(message).splitlines() if part.strip())


def report_user_error(error: object) -> int:
    """Print `weft: error: <error>` as one line and return the exit status for user errors (2).

    One write, newline included: under torchrun every rank reports at once into one stream, and
    separate writes of message and newline (unbuffered stderr) would interleave.
    """
    sys.stderr.write(f"{PREFIX}{one_line(error)}\n")
    sys.stderr.flush()
    return EXIT_USER_ERROR
