import logging

import pytest


@pytest.fixture(autouse=True)
def restore_weft_logger():
    """train.train() gives the "weft" logger its own handler and stops propagation, as a program
    should; tests that run it in-process must not leave that to the tests after them (caplog
    listens at the root logger)."""
    logger = logging.getLogger("weft")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
