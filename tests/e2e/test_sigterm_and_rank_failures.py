"""SIGTERM ends a process promptly even when the training loop cannot be reached; a bad
input under torchrun fails the same one-line way on every rank, without hanging; single-process
checkpoint I/O prints no warning.

(That SIGTERM at a reachable loop saves and exits 0 is tests/components/test_checkpoint.py's
test_sigterm_saves_and_exits_cleanly.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.support.dist_utils import free_port
from tests.support.failure_checks import REPO, assert_clean_failure, python, python_path, run_command, snapshot

# A process that installs weft's SIGTERM handling, then never returns to the training loop:
# as a rank blocked in a collective after another rank failed, or in a long allocation.
BLOCKED = """
import time
from weft.components.distributed.processes import Preemption
preemption = Preemption(grace_s=2.0)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def start_blocked() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    return proc


@pytest.mark.parametrize("sigterms, within_s, says", [
    (1, 8.0, "did not reach the end of its step within 2 s"),
    (2, 1.5, "a second SIGTERM"),
])
def test_sigterm_ends_a_process_whose_loop_never_comes(sigterms, within_s, says):
    proc = start_blocked()
    start = time.monotonic()
    for _ in range(sigterms):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - start < within_s
    assert code == 128 + signal.SIGTERM
    err = proc.stderr.read()
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


TORCHRUN = python("-m", "torch.distributed.run", "--nproc_per_node", "2")  # and a free --master_port


@pytest.mark.slow
def test_bad_input_under_torchrun_fails_on_every_rank_at_once(tmp_path):
    """A dump folder that is a file used to fail rank 0 only, leaving the others in a barrier
    until torchrun killed them; every check now runs on every rank before any process group.
    (One torchrun case: each costs two interpreter starts; the other checks are the same code
    in-process, in test_bad_inputs.py.)"""
    (tmp_path / "taken").write_text("a file, not a folder")
    argv = ["train.py", "--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "taken"),
            "--training.steps", "2", "--training.seq_len", "32"]
    before = snapshot(tmp_path)
    outcome = run_command([*TORCHRUN, "--master_port", str(free_port()), *argv])
    assert_clean_failure(outcome, "job.dump_folder: " + str(tmp_path / "taken") + " is a file", processes=2,
                         before=before, root=tmp_path)


def test_single_process_checkpoint_io_prints_nothing(tmp_path):
    """DCP's two-line "torch.distributed is disabled" warning on every single-process save and
    load is noise (a subprocess: pytest resets warning filters around each test)."""
    script = (
        "import torch\n"
        "from pathlib import Path\n"
        "from weft.components.checkpoint.checkpointer import dcp_call\n"
        f"folder = Path({str(tmp_path / 'step-1')!r})\n"
        "dcp_call('save', {'x': torch.ones(3)}, folder)\n"
        "state = {'x': torch.zeros(3)}\n"
        "dcp_call('load', state, folder)\n"
        "assert state['x'].sum() == 3\n"
    )
    outcome = run_command(python("-c", script))
    assert outcome.code == 0 and outcome.stdout == outcome.stderr == "", outcome.stderr
