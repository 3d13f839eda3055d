"""Micro-batches prepared ahead of the training step, in a background thread.

`prefetch(loader, ...)` returns a `Prefetcher`: an iterator of `Batch`es that a daemon thread builds
up to `depth` ahead (on CUDA in pinned memory), over a gloo exchange group of its own. It stands in
for the loader: `state_dict()` is the loader's state before the first batch not yet taken, so a
resume continues on exactly that batch. An exception in the thread is raised by `next()`. Why the
thread fills its queue whatever the timing, and stops at interpreter exit: docs/data.md.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

from weft.components.data.batch import Batch
from weft.components.data.loader import Loader
from weft.components.distributed.processes import shared_gloo_group

__all__ = ["Prefetcher", "prefetch"]

# How long the thread waits on a full queue before it checks whether it was closed, and the main
# thread on an empty one before it checks that the thread is still alive.
_POLL_S = 0.05
# How long the interpreter's exit waits for a thread the caller did not close (a rank that is gone
# can hold its peers' threads in an exchange; past this the exit goes on).
_EXIT_JOIN_S = 10.0


class Prefetcher:
    """The loader's batches, built `depth` ahead by a daemon thread started by the first `next()`;
    the thread counts lengths with the other ranks over `exchange_group` (None: alone)."""

    def __init__(self, loader: Loader, *, exchange_group: dist.ProcessGroup | None, document_masking: bool = False,
                 device: torch.device | str | None = None, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.loader = loader
        self.exchange_group = exchange_group
        self.document_masking = document_masking
        self.depth = depth
        self.device = torch.device(device) if device is not None else None
        # Pinned memory only helps (and only exists) for copies to a CUDA device.
        self.pin_memory = self.device is not None and self.device.type == "cuda"
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._closing = threading.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._taken: tuple[dict, int, int] | None = None  # (state, truncated, dropped) after the last batch taken

    # -- the iterator -----------------------------------------------------------------------

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise StopIteration
        if self._thread is None:
            self._start()
        kind, payload = self._get()
        if kind == "error":
            self._failure = payload
            raise payload
        batch, self._taken = payload
        return batch

    def _start(self) -> None:
        self._taken = self._loader_snapshot()
        self._queue = queue.Queue(maxsize=self.depth)
        self._closing.clear()
        self._thread = threading.Thread(target=self._produce, args=(self._queue,), name="weft-data-prefetch",
                                        daemon=True)  # never keeps the process alive at exit
        self._thread.start()
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """The caller did not close it: stop the thread before the interpreter finalizes."""
        self._closing.set()
        self._thread.join(timeout=_EXIT_JOIN_S)

    def _get(self) -> tuple[str, Any]:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("data prefetch thread ended without a batch or an error") from None

    # -- the thread -------------------------------------------------------------------------

    def _produce(self, out: queue.Queue) -> None:
        """Build batches into `out` until closed (seen only while the queue is full) or failed."""
        try:
            if self.pin_memory:  # pin where the CUDA context is: this thread's device defaults to 0
                torch.cuda.set_device(self.device)
            for batch in self.loader.stream(self.exchange_group, document_masking=self.document_masking):
                if self.pin_memory:
                    batch = batch.pin_memory()
                if not self._put(out, ("batch", (batch, self._loader_snapshot()))):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who raises it
            self._put(out, ("error", error))

    def _put(self, out: queue.Queue, item: tuple[str, Any]) -> bool:
        """Queue `item`, waiting for room; False if closed meanwhile (the item is dropped)."""
        while True:
            try:
                out.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if self._closing.is_set():
                    return False

    def _loader_snapshot(self) -> tuple[dict, int, int]:
        return (self.loader.state_dict(), self.loader.truncated, self.loader.dropped)

    # -- the loader's interface -------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The loader state before the next batch not yet taken."""
        return dict(self._taken[0]) if self._taken is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load the loader's state; the next `next()` starts a thread from there."""
        self.close()
        self.loader.load_state_dict(state)
        self._closed, self._failure, self._taken = False, None, None

    @property
    def truncated(self) -> int:
        return self._taken[1] if self._taken is not None else self.loader.truncated

    @property
    def dropped(self) -> int:
        return self._taken[2] if self._taken is not None else self.loader.dropped

    def close(self) -> None:
        """Stop the thread: it ends once the queue is full (every rank's thread then has made the
        same exchanges) or it has failed; the batches built ahead are dropped. `next()` after
        `close()` stops the iteration, until `load_state_dict` is called."""
        self._closed = True
        if self._thread is None:
            return
        atexit.unregister(self._stop_at_exit)
        self._closing.set()
        self._thread.join()
        self._thread, self._queue = None, None


def prefetch(loader: Loader, *, document_masking: bool = False, device: torch.device | str | None = None,
             depth: int = 2) -> Prefetcher:
    """The loader's `Batch`es, prepared `depth` ahead in a background thread (pinned for a CUDA
    `device`); use it in place of the loader, state_dict included. The thread's exchanges go over
    a gloo group of their own if the loader counts lengths with other ranks. Every rank calls it
    at the same point: the first call creates that group."""
    group = shared_gloo_group("data prefetch") if loader.exchange_group is not None else None
    return Prefetcher(loader, exchange_group=group, document_masking=document_masking, device=device, depth=depth)
