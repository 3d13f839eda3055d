"""Built-in flavors cut to fewer blocks, for layout sweeps whose checks need every kind of block once,
not four of them: each block a rank runs costs its hooks, collectives and DTensor dispatch every step."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from weft.models import spec_for_flavor


@contextmanager
def fewer_blocks(blocks: dict[str, int]) -> Iterator[None]:
    """Each flavor named in `blocks` (flavor -> n_layers) with that many blocks while inside (in this
    process), as it was after."""
    saved = {name: spec_for_flavor(name).flavors[name] for name in blocks}
    try:
        for name, args in saved.items():
            spec_for_flavor(name).flavors[name] = replace(args, n_layers=blocks[name])
        yield
    finally:
        for name, args in saved.items():
            spec_for_flavor(name).flavors[name] = args
