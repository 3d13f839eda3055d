"""The run's log: one "weft" logger, to stdout, set up once per process by rank."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("weft")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, each line tagged with its rank."""
    fmt = "[weft %(asctime)s] %(message)s" if rank == 0 else f"[weft rank {rank} %(asctime)s] %(message)s"
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
