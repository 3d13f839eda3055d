"""torchao, imported without its start-up noise: every weft import of torchao goes through here
(and the transformers backend's first import of transformers' modeling code, which imports it).

Importing torchao logs a line for each optional kernel library it cannot load (`Failed to load
.../_C_mxfp8...so`, `_C_cutlass_90a`; none of them needed by NF4 or float8 training) and, on torch
2.13, `_pytree`'s deprecation of its Enum `register_constant` calls. Those two messages are
dropped during the import; any other warning still shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# logger -> text of the start-up lines dropped from it
_NOISE = {"torchao": "Failed to load ", "torch.utils._pytree": "is an Enum subclass and is now natively supported"}


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Around an import of torchao (or of a module of it): its start-up noise is dropped."""
    drops = [(logging.getLogger(name), _Drop(text)) for name, text in _NOISE.items()]
    for log, drop in drops:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log, drop in drops:
            log.removeFilter(drop)
