"""The tests' name for the library's multi-process helpers (components/testing.py)."""

from weft.components.testing import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
