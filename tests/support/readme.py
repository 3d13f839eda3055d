"""Code the README shows, read from it, so that tests run what a reader copies."""

from __future__ import annotations

import re

from tests.support import REPO


def readme_example() -> str:
    """The one Python block of the section "Use weft's transforms on your own model"."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use weft's transforms on your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section holds exactly one Python example"
    return blocks[0]
