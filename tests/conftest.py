import logging

import pytest

# The "weft" logger as Python creates it, before any test runs train.py in-process.
_WEFT = logging.getLogger("weft")
_PRISTINE = (list(_WEFT.handlers), _WEFT.level, _WEFT.propagate)


@pytest.fixture(autouse=True)
def restore_weft_logger():
    """train.train() gives the "weft" logger its own handler and stops propagation, as a program
    should; tests that run it in-process must not leave that to the tests after them (caplog
    listens at the root logger). Restored to the pristine state, not to the state the test
    began in: a module-scoped fixture that ran train.py sets up before this fixture does."""
    yield
    _WEFT.handlers[:], _WEFT.level, _WEFT.propagate = list(_PRISTINE[0]), _PRISTINE[1], _PRISTINE[2]
