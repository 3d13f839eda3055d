"""Checkpoints with PyTorch Distributed Checkpoint (DCP): save, resume, resume in another layout.

A checkpoint is a folder `<dump_folder>/<checkpoint.folder>/step-<N>/` written by `dcp.save`
from every rank. It holds the model and optimizer state keyed by parameter name (so DCP can
reshard them into any other layout on load), the LR scheduler, the data loader's global cursor
(identical on every rank, so it too loads under any data-parallel degree), the step and the RNG
state, and any state registered in `Checkpointer.states` (fault tolerance's DiLoCo). A file `COMPLETE` is written into the folder only after every rank's data and DCP's
metadata are on disk; folders without it are never loaded and never count towards
`keep_latest_k`, so an interrupted save cannot replace the last good checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Collection
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions

from weft.components.checkpoint.save_errors import (
    SaveError,
    first_error,
    folder_bytes,
    free_bytes,
    held_bytes,
    shortage,
    write_failure,
)
from weft.components.checkpoint.state import (
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
    whole_model,
)
from weft.components.config import Checkpoint
from weft.components.distributed.processes import shared_gloo_group
from weft.components.distributed.timeouts import keep_long_timeout
from weft.errors import UserError, one_line
from weft.layers.nf4_experts import NF4Experts

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
    error = first_error(error)
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


# Wrappers that activation checkpointing and torch.compile put around a module: they appear in
# parameter names but not in the names DCP saves (get_model_state_dict drops them too).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def saved_name(name: str) -> str:
    """`name` as a checkpoint saves it: without the wrappers AC and compile put in parameter names."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _expected_shapes(model: torch.nn.Module) -> tuple[dict[str, torch.Size], set[str]]:
    """(global shape of each distinct parameter, every state-dict name) of `model`, by the names
    a checkpoint saves. Works on a meta model and on a parallelised one (a DTensor's shape is global).
    A stack of experts already in NF4 (QLoRA's start-up) is the plain weight it quantizes, as saved."""
    nf4 = {name: torch.Size((m.codes.shape[0], *m.expert_shape))
           for name, m in model.named_modules() if isinstance(m, NF4Experts)}

    def plain(name: str) -> str:  # an NF4 piece (codes, scales, ...) stands for its stack's weight
        owner = name.rpartition(".")[0]
        return owner if owner in nf4 else name

    shapes = {saved_name(plain(name)): nf4.get(plain(name), p.shape)
              for name, p in model.named_parameters() if ".lora_" not in name}
    return shapes, {saved_name(plain(name)) for name in model.state_dict() if ".lora_" not in name}  # a base: no LoRA adapters


def model_tensor_metadata(
    checkpoint_dir: str | os.PathLike, model: torch.nn.Module, expected_by: str = "the model"
) -> dict[str, TensorStorageMetadata]:
    """DCP metadata (global shape, dtype) of each parameter of `model`, by saved name, after
    checking that the checkpoint holds exactly that model's tensors with its shapes.

    `model` may be on the meta device. Tied parameters are returned once, under their first
    name (a saved `output.weight` tied to `tok_embeddings.weight` is the same tensor).
    `expected_by` names the shape's source in errors, e.g. "flavor llama3_8b".
    """
    folder = Path(checkpoint_dir)
    metadata = read_dcp_metadata(folder)
    saved = {
        key.removeprefix("model."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    shapes, state_names = _expected_shapes(model)
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


def read_dcp_metadata(folder: Path) -> Any:
    """The checkpoint's DCP metadata (names, shapes, dtypes; no tensor data), or a one-line CheckpointError."""
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unreadable metadata, in one line
        raise CheckpointError(f"checkpoint {folder}: cannot read its DCP metadata "
                              f"({type(e).__name__}: {one_line(e)})") from None


def check_loader_state(folder: Path, expected: dict[str, Any]) -> None:
    """The checkpoint's data position is of the kind of `expected` (the live loader's): a position
    in one dataset (data.dataset_path) and a mixture's (data.mixture) are not interchangeable, and
    DCP would only name a missing key."""
    metadata = read_dcp_metadata(folder)
    saved = {key.removeprefix("dataloader.") for key in metadata.state_dict_metadata if key.startswith("dataloader.")}

    def kind(keys) -> str:
        mixture = any(key.split(".")[0] == "mixture" for key in keys)
        return "a data.mixture's" if mixture else "one dataset's (data.dataset_path)"

    if kind(saved) != kind(expected):
        raise CheckpointError(f"checkpoint {folder}: its data position is {kind(saved)} and this run's data is "
                              f"{kind(expected)}; a run resumes only from a checkpoint of the same kind of data")


def check_optimizer_kind(folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """The checkpoint's optimizer state is of this run's optimizer.name: Muon's momentum buffers and
    AdamW's moments are not interchangeable, and DCP would only name a missing key."""
    keys = [key for key in read_dcp_metadata(folder).state_dict_metadata if key.startswith("optimizer.state.")]
    saved = "Muon" if any(key.endswith(".momentum_buffer") for key in keys) else "AdamW"
    live = "Muon" if any(group.get("use_muon", False) for group in optimizer.param_groups) else "AdamW"
    if keys and saved != live:
        raise CheckpointError(f"checkpoint {folder}: its optimizer state is {saved}'s and this run's optimizer.name is "
                              f"{live}; resume with optimizer.name = {saved}")


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


def resume_folder(cfg: Checkpoint, dump_folder: Path) -> Path | None:
    """The step folder a run resumes its full state from (None: it starts afresh, or from the seed step-0)."""
    root = dump_folder / cfg.folder
    steps = complete_steps(root)
    step = cfg.load_step if cfg.load_step >= 0 else (steps[-1] if steps else 0)
    return step_folder(root, step) if step > 0 else None


class Checkpointer:
    """Saves every `interval` steps, loads the latest complete checkpoint on start.

    A save that fails (no room, a failed write, a failed background save) removes its partial
    folder and raises SaveError, or with `on_save_error = "continue"` logs it and lets training
    go on to the next interval; every rank takes the same decision. `extra_files` (name -> text)
    are written into each full checkpoint before its COMPLETE marker."""

    def __init__(self, cfg: Checkpoint, dump_folder: Path, *, model, optimizer, scheduler, dataloader,
                 extra_files: dict[str, str] | None = None, base_identity: str | None = None):
        """base_identity: set for LoRA: only trainable parameters are saved, with this description
        of the frozen base they were trained on, and a checkpoint of another base is refused."""
        self.cfg = cfg
        self.base_identity = base_identity
        self.root = dump_folder / cfg.folder
        self.model, self.optimizer, self.scheduler, self.dataloader = model, optimizer, scheduler, dataloader
        self.extra_files = dict(extra_files or {})
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0
        self._pending: tuple[int, Future, int] | None = None  # step, future, bytes needed
        self._failure: UserError | None = None  # of the latest save, if it failed under "continue"
        self._protected_before: int | None = None
        # Asynchronous saves run their collectives from a background thread; give them a gloo
        # group of their own so they never interleave with training's NCCL collectives.
        self._async_group = None
        if cfg.async_mode == "async" and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
            keep_long_timeout(self._async_group)  # its gather waits for the slowest writer
        # The ranks agree on every save's outcome over this one (CPU flags, whatever the backend).
        self._agree_group = shared_gloo_group("checkpoint") if cfg.enable or cfg.create_seed_checkpoint else None
        # More state saved with every full checkpoint, by key: objects with state_dict() and
        # load_state_dict() built after the resume (fault tolerance's DiLoCo); read back by load_state.
        self.states: dict[str, Any] = {}

    # -- what is saved ----------------------------------------------------------------------

    def _state(self, step: int, model_only: bool = False) -> dict[str, Any]:
        trainable_only = StateDictOptions(ignore_frozen_params=self.base_identity is not None)
        state: dict[str, Any] = {"model": model_state(self.model, options=trainable_only)}
        if model_only:
            return state
        state["optimizer"] = optimizer_state(self.model, self.optimizer)
        state["lr_scheduler"] = self.scheduler.state_dict()
        state["dataloader"] = self.dataloader.state_dict()
        state["train_state"] = {"step": step, "rng": torch.get_rng_state()}
        if self.base_identity is not None:
            state["train_state"]["lora_base"] = self.base_identity
        for key, stateful in self.states.items():
            state[key] = stateful.state_dict()
        return state

    # -- saving -----------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int, *, model_only: bool = False, blocking: bool = False) -> bool:
        """Save the state after `step`; asynchronously if configured and not `blocking`. False if
        it failed and on_save_error is "continue" (it raises SaveError otherwise)."""
        self.finish_pending(wait=True)  # one save in flight at a time
        folder = step_folder(self.root, step)
        state = self._state(step, model_only)
        needed, basis = self._bytes_needed(state)
        free = free_bytes(self.root)
        problem = None
        if free < needed:
            problem = shortage(folder, step, needed, free, basis)
        elif self.is_writer:
            try:
                self._prepare_folder(folder)
            except CheckpointError as e:
                problem = e
            except OSError as e:
                problem = write_failure(folder, step, e, needed, free)
        if self._any_rank(problem is not None):  # also the barrier: the folder exists before any rank writes
            return self._failed(folder, problem or SaveError(f"checkpoint {folder}: another rank could not save step "
                                                             f"{step}; see its line"))
        if self.cfg.async_mode == "async" and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(folder), process_group=self._async_group)
            self._pending = (step, future, needed)
            logger.info(f"checkpoint: saving step {step} in the background to {folder}")
            return True
        try:
            dcp.save(state, checkpoint_id=str(folder))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises it on every rank
            return self._failed(folder, write_failure(folder, step, e, needed, free_bytes(self.root)))
        self._mark_complete(step, model_only)
        return True

    def _prepare_folder(self, folder: Path) -> None:
        if (folder / COMPLETE).exists():  # check_resume makes this unreachable; never overwrite one
            raise CheckpointError(f"checkpoint {folder} already exists; refusing to overwrite it")
        if folder.is_dir():  # a leftover of an interrupted save of this same step
            shutil.rmtree(folder)
        elif folder.exists():
            raise CheckpointError(f"checkpoint {folder} is a file, not a folder; move it away")
        folder.mkdir(parents=True)

    def _bytes_needed(self, state: dict[str, Any]) -> tuple[int, str]:
        """The previous full checkpoint's size, else this rank's state bytes times the world size."""
        previous = [step for step in complete_steps(self.root) if step > 0]
        if previous and "optimizer" in state:
            return folder_bytes(step_folder(self.root, previous[-1])), f"the size of step-{previous[-1]}"
        world = dist.get_world_size() if dist.is_initialized() else 1
        return held_bytes(state) * world, "the size of the state to save"

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (a collective on the agreement group)."""
        value = torch.tensor([int(flag)])
        if self._agree_group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._agree_group)
        return bool(value.item())

    def _failed(self, folder: Path, error: UserError) -> bool:
        """Remove the partial folder; raise `error`, or log it under on_save_error = "continue"."""
        if self.is_writer and folder.is_dir() and not (folder / COMPLETE).exists():
            shutil.rmtree(folder, ignore_errors=True)
        if self.cfg.on_save_error == "stop":
            raise error
        self._failure = error
        logger.error(f"{error} (checkpoint.on_save_error = continue: training on, next try at the next interval)")
        return False

    def finish_pending(self, wait: bool) -> None:
        """Mark a finished background save complete (waiting for it if `wait`), or report its failure.

        Without `wait` the ranks first agree that every one of them has finished, so all report
        (or mark) it at the same step."""
        if self._pending is None:
            return
        step, future, needed = self._pending
        if not wait and self._any_rank(not future.done()):
            return
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported in one line
            folder = step_folder(self.root, step)
            self._failed(folder, write_failure(folder, step, e, needed, free_bytes(self.root)))
            return
        self._mark_complete(step, model_only=False)

    def _mark_complete(self, step: int, model_only: bool) -> None:
        self._failure = None
        folder = step_folder(self.root, step)
        if self.is_writer:
            for name, text in ({} if model_only else self.extra_files).items():
                (folder / name).write_text(text)
            # dcp.save returns on the coordinator only after every rank's files and the metadata
            # are written; the marker is written last, by rename, so it is never half there.
            marker = folder / f".{COMPLETE}.tmp"
            marker.write_text(f"step {step}\n")
            marker.rename(folder / COMPLETE)
            logger.info(f"checkpoint: step {step} saved to {folder}")
            self._prune()

    def protect_before(self, step: int) -> None:
        """Never prune the newest checkpoint saved before `step` (the first non-finite step)."""
        if self._protected_before is None:
            self._protected_before = step

    def _prune(self) -> None:
        """Keep the newest keep_latest_k complete checkpoints (0 keeps all) and the protected one;
        drop stale partial ones."""
        steps = complete_steps(self.root)
        protected = None
        if self._protected_before is not None:
            protected = max((s for s in steps if s < self._protected_before), default=None)
        if self.cfg.keep_latest_k > 0:
            for old in steps[: -self.cfg.keep_latest_k]:
                if old != protected:
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
            model_tensor_metadata(folder, whole_model(self.model))  # names and shapes, before reading anything
        else:
            self._check_lora_base(folder)
        state = self._state(step=0)
        check_loader_state(folder, state["dataloader"])
        check_optimizer_kind(folder, self.optimizer)
        dcp_call("load", state, folder)
        load_model_state(self.model, state["model"], strict=self.base_identity is None)
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.dataloader.load_state_dict(state["dataloader"])
        torch.set_rng_state(state["train_state"]["rng"])
        if state["train_state"]["step"] != step:
            raise CheckpointError(f"checkpoint {folder} holds step {state['train_state']['step']}, not {step}")
        logger.info(f"checkpoint: resumed from step {step} ({folder})")

    def load_state(self, key: str, step: int) -> bool:
        """Load states[key] from the checkpoint of `step`, in any layout; False (nothing loaded) if
        that checkpoint holds none (a run saved without it)."""
        folder = step_folder(self.root, step)
        if not any(name.startswith(f"{key}.") for name in read_dcp_metadata(folder).state_dict_metadata):
            return False
        state = {key: self.states[key].state_dict()}
        dcp_call("load", state, folder)
        self.states[key].load_state_dict(state[key])
        return True

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
        """Finish a background save; a run whose latest save failed (under "continue") ends with it."""
        self.finish_pending(wait=True)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise SaveError(f"the run's last checkpoint could not be saved: {failure}")


def load_model_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                       names: Collection[str] | None = None) -> None:
    """Load only the model's weights from a complete DCP checkpoint (e.g. a seed checkpoint), into
    a model of any layout: DCP reshards them. names: only these parameters (DCP reads no others)."""
    folder = require_complete_checkpoint(checkpoint_dir)
    model_tensor_metadata(folder, whole_model(model))
    state = {"model": {k: v for k, v in model_state(model).items()  # the base only
                       if ".lora_" not in k and (names is None or k in names)}}
    dcp_call("load", state, folder)
    partial = names is not None or any(".lora_" in n for n, _ in model.named_parameters())
    load_model_state(model, state["model"], strict=not partial)


def load_adapter_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load the trainable parameters (a LoRA run's adapters: all its checkpoints hold of the model)
    from a complete DCP checkpoint into `model`, in any layout; the frozen base is left as it is."""
    folder = require_complete_checkpoint(checkpoint_dir)
    state = {"model": model_state(model, options=StateDictOptions(ignore_frozen_params=True))}
    if not state["model"]:
        raise CheckpointError(f"checkpoint {folder}: the model has no trainable parameters to load")
    dcp_call("load", state, folder)
    load_model_state(model, state["model"], strict=False)
