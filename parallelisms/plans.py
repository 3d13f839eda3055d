"""Tensor-parallel plans, knowing no model: a plan maps module paths to PyTorch `ParallelStyle`s,
and its paths are matched one dotted component at a time (`path_matches`, which `apply_tp` and
`lora_tp_plan` both use)."""

from __future__ import annotations

import fnmatch

from torch.distributed.tensor.parallel import ParallelStyle

Plan = dict[str, ParallelStyle]


def path_matches(name: str, pattern: str) -> bool:
    """Whether module path `name` matches plan path `pattern`, component by component (`*` is any
    one component: "layers.*.attention.wq" matches "layers.3.attention.wq", not "layers.3.x.wq")."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))
