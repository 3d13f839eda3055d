"""What a training step whose loss or gradient norm is NaN or infinite does: stop, or skip its update.

The decision is taken from the global gradient norm, which clipping has already reduced over every
rank, so all ranks see the same value and decide alike without another collective. A non-finite
loss on any rank makes its gradients, and so the global norm, non-finite too; the local loss is
named in the message as well.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from weft.errors import UserError

logger = logging.getLogger("weft")


class NonFiniteError(UserError):
    """A step with a non-finite loss or gradient norm under `stop` (or too many skips in a row)."""


class NonFinitePolicy:
    """`stop`: raise NonFiniteError at the first non-finite step, before its update or any save.
    `skip`: leave out that step's update (the caller does not step the optimizer, the LR schedule
    or anything else that follows the update) and count it; raise after `max_skipped_steps`
    consecutive skips. `ignore` (not a config choice: a simulated rank, whose fake collectives
    leave its values meaningless): every update goes ahead, nothing is read back."""

    def __init__(self, on_nonfinite: str, max_skipped_steps: int, *, on_first: Callable[[int], None] | None = None,
                 before_stop: Callable[[], None] | None = None) -> None:
        """on_first(step): called at the first non-finite step (the checkpointer protects the last
        good checkpoint); before_stop(): called before raising (a background save of an earlier,
        finite step finishes)."""
        if on_nonfinite not in ("stop", "skip", "ignore"):
            raise ValueError(f"on_nonfinite: expected stop, skip or ignore, got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.skipped = 0  # in the whole run
        self.consecutive = 0
        self.first_nonfinite_step: int | None = None
        self._on_first, self._before_stop = on_first, before_stop

    def allows_update(self, step: int, grad_norm: float | torch.Tensor, loss: float | torch.Tensor) -> bool:
        """Whether step `step` may update the weights; raises NonFiniteError to stop the run.
        Tensors are read back together (one device sync a step)."""
        if self.on_nonfinite == "ignore":
            return True
        if isinstance(grad_norm, torch.Tensor) or isinstance(loss, torch.Tensor):
            norm, loss_ = torch.as_tensor(grad_norm).float(), torch.as_tensor(loss).float()
            # on the loss's device: with FSDP's CPU offload the norm of the CPU gradients is on the CPU
            grad_norm, loss = torch.stack([norm.to(loss_.device), loss_]).tolist()
        if math.isfinite(grad_norm) and math.isfinite(loss):
            self.consecutive = 0
            return True
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = step
            if self._on_first is not None:
                self._on_first(step)
        values = f"step {step}: loss {loss:g} (this rank), gradient norm {grad_norm:g}"
        if self.on_nonfinite == "stop":
            self._stopping()
            raise NonFiniteError(f"{values}: not finite; stopped before its update (training.on_nonfinite = stop), "
                                 "no checkpoint holds it; lower optimizer.lr, or set training.on_nonfinite = skip")
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_skipped_steps:
            self._stopping()
            raise NonFiniteError(f"{values}: not finite for {self.consecutive} steps in a row "
                                 f"(training.max_skipped_steps = {self.max_skipped_steps}); stopped, no checkpoint "
                                 "holds a non-finite state")
        logger.warning(f"{values}: not finite; optimizer step skipped ({self.consecutive} in a row, {self.skipped} "
                       f"in all; training.max_skipped_steps = {self.max_skipped_steps})")
        return False

    def _stopping(self) -> None:
        if self._before_stop is not None:
            self._before_stop()
