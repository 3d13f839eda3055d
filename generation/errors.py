"""The engine's one error type."""

from __future__ import annotations

from weft.errors import UserError


class GenerationError(UserError):
    """A bad argument to `generate`, or a layout it cannot run: one line naming it, its value and what
    was expected."""
