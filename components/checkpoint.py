"""Checkpoints with PyTorch Distributed Checkpoint (DCP): save, resume, resume in another layout.

A checkpoint is a folder `<dump_folder>/<checkpoint.folder>/step-<N>/` written by `dcp.save`
from every rank. It holds the model and optimizer state keyed by parameter name (so DCP can
reshard them into any other layout on load), the LR scheduler, the data loader's global cursor
(identical on every rank, so it too loads under any data-parallel degree), the step and the RNG
state. A file `COMPLETE` is written into the folder only after every rank's data and DCP's
metadata are on disk; folders without it are never loaded and never count towards
`keep_latest_k`, so an interrupted save cannot replace the last good checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from components.config import Checkpoint
from components.errors import UserError, one_line
from models.llama import ModelArgs, Transformer

logger = logging.getLogger("weft")

COMPLETE = "COMPLETE"

# Without a process group DCP saves and loads in this process alone, and says so in a two-line
# warning on every save and load: exactly the intent of a single-process run, so it is noise.
# Filtered for the whole process (not around each call) because async saves warn from DCP's
# background thread, which a `catch_warnings` block in this thread does not reach.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message is one line naming the folder and why."""


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match and (child / COMPLETE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def listing(names: list[str], limit: int = 4) -> str:
    """'a, b, c' (at most `limit` names, then how many more), for one-line errors."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def require_complete_checkpoint(checkpoint_dir: str | os.PathLike) -> Path:
    """The DCP step folder as a Path, if it exists and its save finished (it holds COMPLETE).

    A checkpoint root (the folder holding step-N folders) is named as such, with the step
    folder the user most likely meant, rather than reported as an unfinished save."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise CheckpointError(f"no checkpoint folder at {folder}: it {what}")
    if not (folder / COMPLETE).is_file():
        steps = complete_steps(folder)
        if steps:
            raise CheckpointError(f"{folder} is a checkpoint root, not a step folder; "
                                  f"name one of its step folders, e.g. {step_folder(folder, steps[-1])}")
        if any(_STEP_FOLDER.match(child.name) for child in folder.iterdir()):
            raise CheckpointError(f"{folder} is a checkpoint root whose step folders all lack {COMPLETE} "
                                  f"(no save finished)")
        nested = complete_steps(folder / "checkpoint")
        if nested:
            raise CheckpointError(f"{folder} is a dump folder, not a checkpoint step folder; name one of its "
                                  f"step folders, e.g. {step_folder(folder / 'checkpoint', nested[-1])}")
        raise CheckpointError(f"checkpoint {folder} has no {COMPLETE} file: its save did not finish")
    return folder


def checkpoint_failure(folder: Path, action: str, error: BaseException) -> CheckpointError:
    """One-line CheckpointError for a failed DCP read or write of `folder`.

    DCP wraps the failures of every rank in a CheckpointException (a BaseException, so
    `except Exception` misses it) whose text is every rank's whole traceback; the user needs
    only what went wrong first: the exception type and its message, e.g. a truncated file's
    EOFError or a garbled one's UnpicklingError."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (first, _) = min(error.failures.items())
        error = first
    hint = "; is one of its files truncated or corrupt?" if action == "load" else ""
    return CheckpointError(f"checkpoint {folder}: cannot {action} it "
                           f"({type(error).__name__}: {one_line(error) or 'no message'}){hint}")


def dcp_call(action: str, state: dict[str, Any], folder: Path, **kwargs: Any) -> Any:
    """`dcp.save` or `dcp.load` (`action` "save" / "load") of `state` at `folder`, with any
    failure as a one-line CheckpointError.

    Without a process group DCP runs in this process only (see _SINGLE_PROCESS_WARNING)."""
    function = dcp.save if action == "save" else dcp.load
    try:
        return function(state, checkpoint_id=str(folder), **kwargs)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported in one line
        raise checkpoint_failure(folder, action, e) from None


def _expected_shapes(args: ModelArgs) -> tuple[dict[str, torch.Size], set[str]]:
    """(shape of each distinct parameter, every model state-dict name) of a Transformer(args)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: p.shape for name, p in model.named_parameters()}, set(model.state_dict())


def model_tensor_metadata(
    checkpoint_dir: str | os.PathLike, args: ModelArgs, expected_by: str = "the model"
) -> dict[str, TensorStorageMetadata]:
    """DCP metadata (global shape, dtype) of each parameter of a Transformer(args), by weft name,
    after checking that the checkpoint holds exactly that model's tensors with its shapes.

    With tied embeddings only `tok_embeddings.weight` is returned (a saved `output.weight` is
    the same tensor). `expected_by` names the shape's source in errors, e.g. "flavor llama3_8b".
    """
    folder = Path(checkpoint_dir)
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unreadable metadata, in one line
        raise CheckpointError(f"checkpoint {folder}: cannot read its DCP metadata "
                              f"({type(e).__name__}: {one_line(e)})") from None
    saved = {
        key.removeprefix("model."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    shapes, state_names = _expected_shapes(args)
    for name, shape in shapes.items():
        if name in saved and saved[name].size != shape:
            raise CheckpointError(
                f"checkpoint {folder}: model.{name} has shape {list(saved[name].size)}, "
                f"{expected_by} expects {list(shape)}"
            )
    missing = [name for name in shapes if name not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks model tensors of {expected_by}: {listing(missing)}")
    extra = sorted(set(saved) - state_names)
    if extra:
        raise CheckpointError(f"checkpoint {folder} has model tensors not in {expected_by}: {listing(extra)}")
    return {name: saved[name] for name in shapes}


def check_resume(cfg: Checkpoint, dump_folder: Path, last_step: int) -> None:
    """Refuse checkpoint states a run would otherwise misread, before anything is loaded or written:

    - step folders that all lack COMPLETE (every save was interrupted): starting from step 0
      would silently drop them and then overwrite them;
    - a checkpoint past training.steps: there is nothing left to train;
    - checkpoint.load_step below a later complete checkpoint: training on would overwrite it.
    """
    root = dump_folder / cfg.folder
    steps = complete_steps(root)
    partial = sorted(child.name for child in root.iterdir() if _STEP_FOLDER.match(child.name)) if root.is_dir() else []
    if partial and not steps:
        raise CheckpointError(
            f"checkpoint folder {root}: no complete checkpoint, only unfinished saves ({listing(partial)}, without "
            f"{COMPLETE}); move them away to start afresh, or use another dump folder")
    if cfg.load_step >= 0 and cfg.load_step not in steps:
        raise CheckpointError(f"checkpoint.load_step = {cfg.load_step}: no complete checkpoint "
                              f"{step_folder(root, cfg.load_step)} (complete: {steps or 'none'})")
    start = cfg.load_step if cfg.load_step >= 0 else (steps[-1] if steps else 0)
    if start > last_step:
        raise CheckpointError(f"training.steps = {last_step}: the checkpoint {step_folder(root, start)} is already "
                              f"past it; raise training.steps to continue")
    later = [step for step in steps if step > start]
    if later:
        raise CheckpointError(f"checkpoint.load_step = {start}: later checkpoints exist ({listing([str(s) for s in later])}) "
                              f"and would be overwritten; copy step-{start} into another dump folder to branch from it")


class Checkpointer:
    """Saves every `interval` steps, loads the latest complete checkpoint on start."""

    def __init__(self, cfg: Checkpoint, dump_folder: Path, *, model, optimizer, scheduler, dataloader,
                 base_identity: str | None = None):
        """base_identity: set for LoRA: only trainable parameters are saved, with this description
        of the frozen base they were trained on, and a checkpoint of another base is refused."""
        self.cfg = cfg
        self.base_identity = base_identity
        self.root = dump_folder / cfg.folder
        self.model, self.optimizer, self.scheduler, self.dataloader = model, optimizer, scheduler, dataloader
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0
        self._pending: tuple[int, Future] | None = None
        # Asynchronous saves run their collectives from a background thread; give them a gloo
        # group of their own so they never interleave with training's NCCL collectives.
        self._async_group = None
        if cfg.async_mode == "async" and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")

    # -- what is saved ----------------------------------------------------------------------

    def _state(self, step: int, model_only: bool = False) -> dict[str, Any]:
        trainable_only = StateDictOptions(ignore_frozen_params=self.base_identity is not None)
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=trainable_only)}
        if model_only:
            return state
        state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        state["lr_scheduler"] = self.scheduler.state_dict()
        state["dataloader"] = self.dataloader.state_dict()
        state["train_state"] = {"step": step, "rng": torch.get_rng_state()}
        if self.base_identity is not None:
            state["train_state"]["lora_base"] = self.base_identity
        return state

    # -- saving -----------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int, *, model_only: bool = False, blocking: bool = False) -> None:
        """Save the state after `step`; asynchronously if configured and not `blocking`."""
        self.finish_pending(wait=True)  # one save in flight at a time
        folder = step_folder(self.root, step)
        if self.is_writer:
            if (folder / COMPLETE).exists():  # check_resume makes this unreachable; never overwrite one
                raise CheckpointError(f"checkpoint {folder} already exists; refusing to overwrite it")
            if folder.is_dir():  # a leftover of an interrupted save of this same step
                shutil.rmtree(folder)
            elif folder.exists():
                raise CheckpointError(f"checkpoint {folder} is a file, not a folder; move it away")
            folder.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()
        state = self._state(step, model_only)
        if self.cfg.async_mode == "async" and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(folder), process_group=self._async_group)
            self._pending = (step, future)
            logger.info(f"checkpoint: saving step {step} in the background to {folder}")
        else:
            dcp_call("save", state, folder)
            self._mark_complete(step)

    def finish_pending(self, wait: bool) -> None:
        """Mark a finished background save complete (waiting for it if `wait`)."""
        if self._pending is None:
            return
        step, future = self._pending
        if not wait and not future.done():
            return
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported in one line
            raise checkpoint_failure(step_folder(self.root, step), "save", e) from None
        finally:
            self._pending = None
        self._mark_complete(step)

    def _mark_complete(self, step: int) -> None:
        folder = step_folder(self.root, step)
        if self.is_writer:
            # dcp.save returns on the coordinator only after every rank's files and the metadata
            # are written; the marker is written last, by rename, so it is never half there.
            marker = folder / f".{COMPLETE}.tmp"
            marker.write_text(f"step {step}\n")
            marker.rename(folder / COMPLETE)
            logger.info(f"checkpoint: step {step} saved to {folder}")
            self._prune()

    def _prune(self) -> None:
        """Keep the newest keep_latest_k complete checkpoints (0 keeps all); drop stale partial ones."""
        steps = complete_steps(self.root)
        if self.cfg.keep_latest_k > 0:
            for old in steps[: -self.cfg.keep_latest_k]:
                shutil.rmtree(step_folder(self.root, old), ignore_errors=True)
        newest = steps[-1] if steps else -1
        for child in self.root.iterdir():
            match = _STEP_FOLDER.match(child.name)
            if match and int(match.group(1)) < newest and not (child / COMPLETE).exists():
                shutil.rmtree(child, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------

    def resume_step(self) -> int | None:
        """The step to resume from: checkpoint.load_step if set, else the latest complete one."""
        steps = complete_steps(self.root)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"{step_folder(self.root, self.cfg.load_step)} (complete: {steps or 'none'})"
                )
            return self.cfg.load_step
        return steps[-1] if steps else None

    def load(self, step: int) -> None:
        """Load the full training state saved after `step` into the live objects, in any layout."""
        folder = step_folder(self.root, step)
        if self.base_identity is None:
            model_tensor_metadata(folder, self.model.args)  # names and shapes, before reading anything
        else:
            self._check_lora_base(folder)
        state = self._state(step=0)
        dcp_call("load", state, folder)
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=self.base_identity is None))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state["dataloader"])
        torch.set_rng_state(state["train_state"]["rng"])
        if state["train_state"]["step"] != step:
            raise CheckpointError(f"checkpoint {folder} holds step {state['train_state']['step']}, not {step}")
        logger.info(f"checkpoint: resumed from step {step} ({folder})")

    def _check_lora_base(self, folder: Path) -> None:
        """An adapter checkpoint resumes only onto the base it was trained on (and only in a LoRA run)."""
        state = {"train_state": {"lora_base": ""}}
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except (Exception, CheckpointException):  # noqa: BLE001 - no record: a full checkpoint
            raise CheckpointError(f"checkpoint {folder} is not a LoRA adapter checkpoint (it records no base "
                                  "model); resume it with lora.enable = false") from None
        saved = state["train_state"]["lora_base"]
        if saved != self.base_identity:
            raise CheckpointError(f"checkpoint {folder} holds adapters trained on base [{saved}], this run's base is "
                                  f"[{self.base_identity}]; set checkpoint.initial_load_path (and model) to that base")

    def close(self) -> None:
        self.finish_pending(wait=True)


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load only the model's weights from a complete DCP checkpoint (e.g. a seed checkpoint), into
    a model of any layout: DCP reshards them."""
    folder = require_complete_checkpoint(checkpoint_dir)
    model_tensor_metadata(folder, model.args)
    state = {"model": {k: v for k, v in get_model_state_dict(model).items() if ".lora_" not in k}}  # base only
    dcp_call("load", state, folder)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not any(".lora_" in n for n, _ in model.named_parameters())))
