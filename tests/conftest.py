import logging
import os
import tempfile

import pytest

from weft.components.data import Tokenizer
from weft.components.distributed.cpu_ranks import preload

from tests.support import ASSETS, slow_scaled_mm

# The "weft" logger as Python creates it, before any test runs train.py in-process.
_WEFT = logging.getLogger("weft")
_PRISTINE = (list(_WEFT.handlers), _WEFT.level, _WEFT.propagate)


@pytest.fixture(scope="session")
def tokenizer():
    """The shipped Shakespeare SentencePiece tokenizer (vocabulary 2,048), loaded once."""
    return Tokenizer(ASSETS / "tokenizer" / "shakespeare.model")


@pytest.fixture(autouse=True)
def restore_weft_logger():
    """train.train() gives the "weft" logger its own handler and stops propagation, as a program
    should; tests that run it in-process must not leave that to the tests after them (caplog
    listens at the root logger). Restored to the pristine state, not to the state the test
    began in: a module-scoped fixture that ran train.py sets up before this fixture does."""
    yield
    _WEFT.handlers[:], _WEFT.level, _WEFT.propagate = list(_PRISTINE[0]), _PRISTINE[1], _PRISTINE[2]


def pytest_configure(config):
    """With WEFT_SLOW_SCALED_MM=<seconds>, every torch._scaled_mm sleeps that long and is counted
    (tests/support/slow_scaled_mm.py), in this process and in the ranks it starts."""
    if os.environ.get(slow_scaled_mm.ENV) and not os.environ.get(slow_scaled_mm.LOG_ENV):
        os.environ[slow_scaled_mm.LOG_ENV] = tempfile.mkstemp(prefix="weft-scaled-mm-", suffix=".log")[1]
    slow_scaled_mm.install()
    preload("weft.train")  # what nearly every rank a test starts imports: once, in the fork server


def pytest_terminal_summary(terminalreporter):
    if os.environ.get(slow_scaled_mm.ENV):
        terminalreporter.write_line(f"torch._scaled_mm calls (each slowed by {os.environ[slow_scaled_mm.ENV]} s): "
                                    f"{slow_scaled_mm.calls_logged()}")
