"""Why a checkpoint could not be saved, in one line: a disk without room for it, a write that failed.

The Checkpointer checks free space before every save against the size of the previous complete
checkpoint (or, for the first, the bytes of the state about to be written), and turns a failed
write into a SaveError: for a full disk or quota (ENOSPC, EDQUOT) the folder, the bytes needed
and the bytes free; for anything else the first error DCP met.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from weft.errors import UserError, one_line

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class SaveError(UserError):
    """A checkpoint that could not be written; its partial folder is gone, earlier ones untouched."""


def held_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict: its shards of sharded ones."""
    if isinstance(state, DTensor):
        return held_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(held_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(held_bytes(value) for value in state)
    return 0


def folder_bytes(folder: Path) -> int:
    """Total size of the files under `folder`."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def free_bytes(path: Path) -> int:
    """Bytes available to this user on the filesystem that holds `path` (or would, once created)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


def first_error(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException, else `error` itself."""
    if isinstance(error, CheckpointException) and error.failures:
        _, (first, _) = min(error.failures.items())
        return first
    return error


def disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT if that is what `error` (or an exception it came from) is."""
    seen: set[int] = set()
    stack = [first_error(error)]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return current.errno
        stack += [current.__cause__, current.__context__]
    return None


def shortage(folder: Path, step: int, needed: int, free: int, basis: str) -> SaveError:
    return SaveError(f"checkpoint {folder}: not enough free space to save step {step}: needs about {needed:,} bytes "
                     f"({basis}), {free:,} free; nothing was written and earlier checkpoints are untouched; free "
                     "space, or point checkpoint.folder at a larger filesystem")


def write_failure(folder: Path, step: int, error: BaseException, needed: int, free: int) -> SaveError:
    """One line for a save that failed while writing; says that the partial folder was removed."""
    code = disk_full_errno(error)
    if code is not None:
        return SaveError(f"checkpoint {folder}: the disk filled while saving step {step} ({errno.errorcode[code]}: "
                         f"{os.strerror(code)}): needs about {needed:,} bytes, {free:,} free; the partial folder was "
                         "removed and earlier checkpoints are untouched; free space, or point checkpoint.folder at a "
                         "larger filesystem")
    first = first_error(error)
    return SaveError(f"checkpoint {folder}: cannot save step {step} ({type(first).__name__}: "
                     f"{one_line(first) or 'no message'}); the partial folder was removed and earlier checkpoints "
                     "are untouched")
