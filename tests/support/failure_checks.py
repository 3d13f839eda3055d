"""What every failed weft command must look like, checked in one place for every adversarial test.

A failed command (train.py, generate.py, `weft export`) given a bad input:
- exits with status 2 (non-zero under torchrun);
- prints exactly one `weft: error: ...` line per process, naming what is wrong (under torchrun:
  per process that got that far before torchrun stopped the rest after the first exit);
- prints no traceback;
- finishes within 60 s;
- leaves every file and folder that existed before it byte-identical, and creates nothing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

TIME_LIMIT_S = 60.0
PREFIX = "weft: error: "
TORCHRUN_TRACEBACK = 'Traceback (most recent call last):\n  File "<frozen runpy>"'


def snapshot(root: Path) -> dict[str, str]:
    """Every file (its SHA-256) and folder ("dir") under root, by relative path."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        state[key] = "dir" if path.is_dir() else _digest(path)
    return state


_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _digest(path: Path) -> str:
    """SHA-256 of a file, remembered by (device, inode, size, mtime): the checkpoints the tests
    share by hard link are hashed once, and any write to a file changes its mtime."""
    stat = path.stat()
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        with path.open("rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    seconds: float


def run_in_process(main: Callable[[list[str]], int], argv: list[str], capsys) -> Outcome:
    """Call a command's `main(argv)` here (no interpreter start: fast); argparse exits count too."""
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err, seconds)


def run_command(command: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO) -> Outcome:
    """Run a command line in a fresh process (as a user would), killed after TIME_LIMIT_S."""
    start = time.monotonic()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **(env or {})}
    try:
        result = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True,
                                timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} did not finish within {TIME_LIMIT_S:.0f} s")
    return Outcome(result.returncode, result.stdout, result.stderr, time.monotonic() - start)


def python_path(*first: str) -> str:
    """PYTHONPATH for a child process: `first`, this process's own PYTHONPATH (which may point
    `weft` at a worktree), then the repository (for `tests` and `benchmarks`)."""
    return os.pathsep.join(filter(None, [*first, os.environ.get("PYTHONPATH"), str(REPO)]))


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def every_rank_failed_or_was_stopped(stderr: str, processes: int) -> bool:
    """Under torchrun, each rank either printed its own `weft: error:` line or was stopped by
    torchrun (SIGTERM) because another rank had already failed: none waited for the others. Which
    ranks print depends on how far each got before the first exit (start-up skew on a loaded
    machine), so the split is not fixed; the sum is."""
    lines = [line for line in stderr.splitlines() if line.startswith(PREFIX)]
    stopped = stderr.count("(SIGTERM)")
    return 1 <= len(lines) <= processes and len(lines) + stopped >= processes


def assert_clean_failure(outcome: Outcome, expected: str | list[str], *, processes: int = 1,
                         before: dict[str, str] | None = None, root: Path | None = None) -> None:
    """The failure contract (module docstring). `expected`: text(s) each error line must contain
    (the key, value or file:line); `before`: the snapshot of `root` taken before the command."""
    report = f"exit {outcome.code}\nstdout:\n{outcome.stdout[-3000:]}\nstderr:\n{outcome.stderr[-3000:]}"
    if processes == 1:
        assert outcome.code == 2, report
    else:
        assert outcome.code != 0, report
    lines = [line for line in outcome.stderr.splitlines() if line.startswith(PREFIX)]
    if processes == 1:
        assert len(lines) == 1, report
    else:
        assert every_rank_failed_or_was_stopped(outcome.stderr, processes), report
    for line in lines:
        for text in [expected] if isinstance(expected, str) else expected:
            assert text in line, f"{text!r} not in {line!r}"
    if processes == 1:  # a lone process's stderr holds only its line
        assert outcome.stderr.strip() == lines[0], report
        assert "Traceback" not in outcome.stdout + outcome.stderr, report
    else:
        # torchrun's own ChildFailedError traceback (it starts in runpy, not in a weft file) is
        # the only one; its closing report names a weft line as the root cause.
        assert outcome.stderr.count("Traceback") == outcome.stderr.count(TORCHRUN_TRACEBACK), report
        assert "traceback : " + PREFIX in outcome.stderr, report
    assert outcome.seconds < TIME_LIMIT_S, f"took {outcome.seconds:.0f} s"
    if before is not None:
        assert snapshot(root) == before, "files changed or were created"
