"""Micro-batches prepared ahead (components/data/prefetch.py): the same batches as the loader, the state
of the batches taken (not of those built ahead), errors raised as themselves, pinned memory only
for CUDA, and a thread that stops."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import pytest
import torch

from weft.components.data import Batch, DataError, Tokenizer, batches, build_loader, prefetch

from tests.support import REPO

TOKENIZER = REPO / "assets/tokenizer/shakespeare.model"
LINES = [f"To be, or not to be{', that is the question' * (i % 4)}: line {i}." for i in range(60)]


def write(path: Path, records: list) -> list[Path]:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return [path]


@pytest.fixture(params=["text", "prompt_completion"])
def make(request, tmp_path, tokenizer):
    """A factory of fresh loaders over the same short records, text or packed prompt/completion."""
    if request.param == "text":
        files = write(tmp_path / "text.jsonl", [{"text": line} for line in LINES])
    else:
        files = write(tmp_path / "pc.jsonl", [{"prompt": a, "completion": b} for a, b in zip(LINES, LINES[1:])])
    return lambda: build_loader(request.param, files, tokenizer, seq_len=47, local_batch_size=2, dp_rank=0,
                                dp_world_size=1, long_samples="drop")


def same(a: Batch, b: Batch) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_state_is_that_of_the_batches_taken(make):
    """After k batches the prefetcher's state is the plain loader's after k, though its thread
    has built more (so are the counts of dropped samples); a new prefetcher loaded with it continues on the uninterrupted batches, and so
    does the same one after load_state_dict (thread restarted)."""
    plain = make()
    want = list(islice(batches(plain, document_masking=True), 9))
    states, dropped = [], []
    reference = make()
    for batch in islice(batches(reference, document_masking=True), 9):
        states.append(reference.state_dict())
        dropped.append(getattr(reference, "dropped", 0))

    ahead = prefetch(make(), document_masking=True)
    for k in range(5):
        assert same(next(ahead), want[k])
        assert ahead.state_dict() == states[k] and ahead.dropped == dropped[k]
    # The thread builds beyond the 5th: 2 batches queued (depth 2) and an 8th in hand, waiting for
    # room. (Waiting for the full queue alone raced the thread's start on the 8th.)
    deadline = time.monotonic() + 10
    while ahead.loader.state_dict() != states[7] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead._queue.full() and ahead.loader.state_dict() == states[7]
    assert ahead.state_dict() == states[4] and ahead.dropped == dropped[4]
    resumed = prefetch(make(), document_masking=True)
    resumed.load_state_dict(ahead.state_dict())
    assert all(same(next(resumed), want[k]) for k in range(5, 9))
    ahead.load_state_dict(states[1])
    assert ahead.state_dict() == states[1] and same(next(ahead), want[2])
    for p in (ahead, resumed):
        p.close()
        assert p._thread is None
    with pytest.raises(StopIteration):
        next(ahead)


def test_data_error_in_the_thread_reaches_the_caller(tmp_path, tokenizer):
    """A bad record met by the thread is raised by next() as the same DataError, after the good
    batches before it, and again on the next call."""
    files = write(tmp_path / "bad.jsonl", [{"text": line} for line in LINES[:20]] + ['{"text": oops}'])
    plain = build_loader("text", files, tokenizer, seq_len=15, local_batch_size=2, dp_rank=0, dp_world_size=1)
    good = 0
    with pytest.raises(DataError, match=r"bad\.jsonl:21: expected a line of JSON") as expected:
        for _ in batches(plain):
            good += 1
    ahead = prefetch(build_loader("text", files, tokenizer, seq_len=15, local_batch_size=2, dp_rank=0,
                                  dp_world_size=1))
    for _ in range(good):
        next(ahead)
    with pytest.raises(DataError) as raised:
        next(ahead)
    assert str(raised.value) == str(expected.value)
    with pytest.raises(DataError):
        next(ahead)
    thread = ahead._thread
    ahead.close()
    assert not thread.is_alive()


def test_pinned_memory_only_for_cuda(make, monkeypatch):
    """Pinning is asked for a CUDA device only (from the thread, on that device), never for the
    CPU; the thread is a daemon, so it never keeps the process alive."""
    pinned, devices = [], []
    monkeypatch.setattr(Batch, "pin_memory", lambda self: pinned.append(self) or self)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    cpu = prefetch(make(), device=torch.device("cpu"))
    next(cpu)
    assert not pinned and not devices and cpu._thread.daemon
    cpu.close()
    cuda = prefetch(make(), device="cuda:1")
    next(cuda)
    assert pinned and devices == [torch.device("cuda:1")]
    cuda.close()


def beside_main_thread_worker(text_files: list[Path], pc_files: list[Path], steps: int) -> dict:
    """On each of 2 ranks: a prefetched text loader (dp 2) whose thread counts lengths with the other
    rank while the main thread, between batches, reads a packed loader of its own (as validation
    does), also counting together."""
    import torch.distributed as dist

    rank, tokenizer = dist.get_rank(), Tokenizer(TOKENIZER)
    train = prefetch(build_loader("text", text_files, tokenizer, seq_len=15, local_batch_size=2, dp_rank=rank,
                                  dp_world_size=2), document_masking=True)
    run: dict = {"train": [], "validation": []}
    for _ in range(steps):
        run["train"].append([t.tolist() for t in next(train) if t is not None])
        validation = build_loader("prompt_completion", pc_files, tokenizer, seq_len=47, local_batch_size=1,
                                  dp_rank=rank, dp_world_size=2, long_samples="drop")
        run["validation"].append([[t.tolist() for t in batch if t is not None] for _, batch in zip(range(2), validation)])
    run["state"] = train.state_dict()
    train.close()
    return run


def test_thread_and_main_thread_count_together_apart(tmp_path, tokenizer):
    """Under 2 ranks, the prefetch thread's length exchanges and those of a loader read in the main
    thread at the same time go over groups of their own: every rank gets its block of the single
    loader's batches from both, and the state of the batches taken."""
    from tests.support.dist_utils import run_distributed

    text = write(tmp_path / "text.jsonl", [{"text": line} for line in LINES])
    pc = write(tmp_path / "pc.jsonl", [{"prompt": a, "completion": b} for a, b in zip(LINES, LINES[1:])])
    steps = 6
    single = build_loader("text", text, tokenizer, seq_len=15, local_batch_size=4, cooperate=False)
    want_train = [[t.tolist() for t in batch if t is not None] for batch in islice(batches(single, document_masking=True), steps)]
    want_state = single.state_dict()
    validation = build_loader("prompt_completion", pc, tokenizer, seq_len=47, local_batch_size=2, cooperate=False,
                              long_samples="drop")
    want_validation = [[t.tolist() for t in batch if t is not None] for batch in islice(validation, 2)]

    runs = run_distributed(beside_main_thread_worker, 2, text, pc, steps, timeout=120)
    for rank, run in enumerate(runs):
        assert run["train"] == [[rows[2 * rank : 2 * rank + 2] for rows in batch] for batch in want_train]
        assert run["state"] == want_state
        for got in run["validation"]:
            assert got == [[rows[rank : rank + 1] for rows in batch] for batch in want_validation]


UNCLOSED = """
import torch
from weft.components.data.prefetch import Prefetcher

class SlowLoader:  # every batch is long GIL-free torch work, as tokenizing and pinning are
    exchange_group, truncated, dropped = None, 0, 0
    def state_dict(self):
        return {}
    def stream(self, group, document_masking=False):
        while True:
            a = torch.randn(400, 400)
            for _ in range(40):
                a = torch.tanh(a @ a)
            yield a

torch.set_num_threads(1)
batches = Prefetcher(SlowLoader(), exchange_group=None)
next(batches)
raise RuntimeError("the step failed")
"""


def test_an_unclosed_prefetcher_lets_the_error_exit_as_itself(tmp_path):
    """A loop that raises never closes the prefetcher. The thread, cut inside a torch call while the
    interpreter finalizes, used to abort the process (exit 134, 'terminate called without an active
    exception'; seen on an H100 after an out-of-memory error): now the error exits as itself, exit 1."""
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith("RuntimeError: the step failed")
    assert "terminate called" not in done.stderr
