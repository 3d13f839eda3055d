"""Fault tolerance across replica groups, on torchft ([fault_tolerance]).

Each replica group is one torchrun job with its own mesh. A torchft Manager joins the group to a
quorum of live groups at each step, averages each gradient shard with the other live groups, and
steps only if every group of the quorum finished its all-reduce; a group that comes back heals
from a live peer before its first forward. Under semi_sync_method = diloco, `DiLoCoGroups`
(diloco.py) syncs every sync_steps steps instead. Off, `NoFaultTolerance` keeps the loop as it
was. How a step runs and why: docs/fault-tolerance.md.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from weft.components.checkpoint.state import load_model_state, load_optimizer_state, model_state, optimizer_state
from weft.components.config import JobConfig
from weft.components.ft.checks import FaultToleranceError, config_identity, lighthouse_address
from weft.components.training.moe_balance import moe_layers
from weft.errors import one_line

logger = logging.getLogger("weft")

# Steps (or DiLoCo syncs) not committed in a row before the run stops: a dying group costs one, so
# more in a row is something that will not pass (fewer live groups than min_replica_groups while the
# lighthouse's --min_replicas lets a quorum form) and would only burn data.
MAX_UNCOMMITTED_IN_A_ROW = 10


@dataclass
class GroupStats:
    """What the log line, TensorBoard and metrics.jsonl show of the groups (components/observe/metrics.py)."""

    participating: int  # groups in this step's quorum
    groups: int  # fault_tolerance.replica_groups
    uncommitted: int  # steps left uncommitted so far (a group died in them, or too few groups)
    heal_seconds: float  # the last heal of this group from a peer (0: none)

    def note(self) -> str:
        heal = f"  healed in {self.heal_seconds:.1f} s" if self.heal_seconds else ""
        return f"groups {self.participating}/{self.groups}  uncommitted {self.uncommitted}{heal}"

    def scalars(self) -> dict[str, float]:
        return {"ft/participating_groups": self.participating, "ft/uncommitted_steps": self.uncommitted,
                "ft/heal_seconds": self.heal_seconds}


class NoFaultTolerance:
    """One job, no groups: every step commits."""

    committed = True
    average_gradients = None
    step = 0

    def steps(self, start_step: int, last_step: int) -> Iterator[int]:
        for self.step in range(start_step + 1, last_step + 1):
            yield self.step

    def should_commit(self) -> bool:
        return True

    def stats(self) -> GroupStats | None:
        return None

    def close(self) -> None:
        pass


class ReplicaGroups:
    """This process's place among the replica groups: a torchft Manager and the step around it.

    state: (save, load) of what a healing group copies from a peer, a dict of tensors and plain
    values (DTensors travel as their local shards: the peer of rank r is rank r of another group,
    with the same layout). model: its MoE layers' token counts ride the gradients' all-reduce."""

    _model: torch.nn.Module | None = None
    diloco = False  # components/ft/diloco.py's DiLoCoGroups: weights synced every sync_steps instead
    _uncommitted_means = "; trying it again with the next batch"

    def __init__(self, cfg: JobConfig, device: torch.device, state: tuple[Callable[[], dict], Callable[[dict], None]],
                 model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own lines for every quorum and commit: off
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        logging.getLogger("torchft.manager").addFilter(_without_flight_recorder_note)
        ft = cfg.fault_tolerance
        self.cfg, self.groups = ft, ft.replica_groups
        self.lighthouse = lighthouse_address(cfg)
        self.identity = float(config_identity(cfg))
        (self._save, self._load), self._scheduler = state, scheduler
        self.uncommitted, self.in_a_row, self.heal_seconds, self.committed = 0, 0, 0.0, True
        self.step, self._healed_step = 0, None
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = ProcessGroupGloo(timeout=timeout) if ft.process_group == "gloo" else ProcessGroupNCCL(timeout=timeout)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        store = {}  # the group's ranks meet in its process group's store (MASTER_ADDR:MASTER_PORT)
        if not dist.is_initialized():  # a group of one process has none: a store of its own
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        try:
            self.manager = Manager(
                pg=pg, load_state_dict=self._heal_from, state_dict=self._state_for_peer,
                min_replica_size=ft.min_replica_groups, use_async_quorum=False,  # heal before the forward
                timeout=timeout, quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=ft.connect_timeout_seconds),
                rank=rank, world_size=world, lighthouse_addr=self.lighthouse,
                replica_id=f"weft_group_{ft.replica_id}", hostname=ft.hostname or _hostname(),
                checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
                init_sync=False,  # every group draws the same seeded weights (the config check says so)
                **store)
        except RuntimeError as e:
            raise self._unreachable(e) from None
        self._start_quorum, self._should_commit = self.manager.start_quorum, self.manager.should_commit
        self.manager.start_quorum, self.manager.should_commit = self._timed_quorum, self._counted_commit
        self._model = model

    def _unreachable(self, error: Exception) -> FaultToleranceError:
        return FaultToleranceError(f"fault_tolerance.lighthouse = {self.lighthouse}: no answer within "
                                   f"{self.cfg.connect_timeout_seconds:g} s (fault_tolerance.connect_timeout_seconds)"
                                   f": {one_line(error)[:200]}")

    def steps(self, start_step: int, last_step: int) -> Iterator[int]:
        """The steps to train. Averaging gradients, each joins the quorum first (healing if this
        group is behind), and is the number of committed steps plus one: an uncommitted step is
        tried again."""
        self.step = start_step
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})
        first = True
        while first or self.manager.current_step() < last_step:
            if first:
                self._join()
            else:
                self.manager.start_quorum()
            first, self._healed_step = False, None
            self.step = self.manager.current_step() + 1
            if self.step > last_step:
                return
            yield self.step

    def _join(self) -> None:
        """A group's first quorum. It waits (quorum_timeout_seconds at most) until every group has
        joined, so that at a start or a restart of all groups none trains alone; it stops waiting
        as soon as it is found behind live groups (it healed from them: they went on without it).
        Under diloco the live groups are at a sync when they join it: this group takes part."""
        start = self.manager.current_step()
        try:
            self.manager.start_quorum()
        except Exception as e:  # where a lighthouse that does not answer shows
            raise self._unreachable(e) from None
        deadline = time.monotonic() + self.cfg.quorum_timeout_seconds
        while (self.manager.num_participants() < self.groups and self.manager.current_step() == start
               and time.monotonic() < deadline):
            time.sleep(0.2)
            self.manager.start_quorum()

    def _timed_quorum(self, *args, **kwargs) -> None:
        """torchft's start_quorum (ours, or DiLoCo's at a sync), timing a heal if it brought one."""
        started = time.monotonic()
        self._start_quorum(*args, **kwargs)
        if self._healed_step is not None:
            self.heal_seconds = time.monotonic() - started
            logger.info(f"fault tolerance: healed from a live group to step {self._healed_step} "
                        f"in {self.heal_seconds:.2f} s")

    def _counted_commit(self, *args, **kwargs) -> bool:
        """torchft's should_commit (ours, or DiLoCo's at a sync), counting the steps it refused."""
        apply = self._before_commit()
        committed = self._should_commit(*args, **kwargs)
        if committed and apply is not None:
            apply()
        self.in_a_row = 0 if committed else self.in_a_row + 1
        if not committed:
            self.uncommitted += 1
            groups = f"{self.manager.num_participants()} of {self.groups} groups"
            logger.warning(f"fault tolerance: step {self.step} not committed ({groups}; "
                           f"{self.manager.errored() or 'too few groups'})"
                           + self._uncommitted_means)
            if self.in_a_row >= MAX_UNCOMMITTED_IN_A_ROW:
                raise FaultToleranceError(
                    f"fault_tolerance: {self.in_a_row} steps in a row not committed (last: {groups}, "
                    f"fault_tolerance.min_replica_groups = {self.cfg.min_replica_groups}); start the missing groups, "
                    "or give the lighthouse --min_replicas the same value so that it waits for them")
        return committed

    def _check_identity(self, averaged: float, step: int) -> None:
        if self.manager.errored() is None and averaged != self.identity:
            raise FaultToleranceError(
                "fault_tolerance: the replica groups were started with different configs (this group's differs "
                f"from the others' at step {step}); start every group with the same "
                "config, only fault_tolerance.replica_id, hostname and job.dump_folder may differ")

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average every gradient (this rank's shard of it) over the live groups, in one all-reduce
        per dtype; a group that dies inside it leaves the step uncommitted. The bucket carries the
        config's hash: groups started with different configs stop at their first step together;
        and the MoE layers' token counts, so that every group moves its routing bias as HSDP does
        (by the mean of the groups' counts: the sign of mean minus load is that of their sum)."""

        grads = [local_tree(p.grad) for p in params if p.grad is not None]
        if self._model is not None:  # the routing counts, summed over every replica as HSDP's are
            grads += [layer.tokens_per_expert for _, layer in moe_layers(self._model)]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        check = None
        for dtype, group in by_dtype.items():
            flat = torch.cat([g.reshape(-1) for g in group])
            if check is None and dtype == torch.float32:
                flat, check = torch.cat([flat, flat.new_full((1,), self.identity)]), True
            self.manager.allreduce(flat).wait()
            if check is True:
                check = flat[-1].item()
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if isinstance(check, float):
            self._check_identity(check, self.manager.current_step() + 1)

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished the step's all-reduce (asked of all of them)."""
        self.committed = self.manager.should_commit()
        return self.committed

    def stats(self) -> GroupStats:
        return GroupStats(self.manager.num_participants(), self.groups, self.uncommitted, self.heal_seconds)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _before_commit(self) -> Callable[[], None] | None:
        """What must ride with a commit and take effect only if it commits (nothing, per step)."""
        return None

    def _state_for_peer(self) -> dict[str, Any]:
        return {"step": self.step, **local_tree(self._save())}

    def _heal_from(self, state: dict[str, Any]) -> None:
        self._load(state)
        self.step = self._healed_step = state["step"]

def training_state(model, optimizer, scheduler, loader) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """(save, load) of what a healing group copies from a peer: model, optimizer, schedule and the
    data position (a position in the global stream, the same in every group at the same step).
    Loaded shards become DTensors again in this rank's layout, which the peer's rank shares."""

    def save() -> dict:
        return {"model": model_state(model), "optimizer": optimizer_state(model, optimizer),
                "scheduler": scheduler.state_dict(), "data": loader.state_dict()}

    def load(state: dict) -> None:
        params = dict(model_state(model))
        load_model_state(model, {k: like_param(v, params[k]) for k, v in state["model"].items()})
        opt = state["optimizer"]
        opt["state"] = {name: {k: like_param(v, params[name]) for k, v in values.items()}
                        for name, values in opt["state"].items()}
        load_optimizer_state(model, optimizer, opt)
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["data"])

    return save, load


def like_param(value: Any, param: Any) -> Any:
    """A received shard as a DTensor laid out as `param` is, when param is one and shapes match."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def _without_flight_recorder_note(record: logging.LogRecord) -> bool:
    """torchft warns at every new quorum that this torch cannot reset NCCL's flight recorder: one
    line per quorum change that no user can act on, left out."""
    return "Unable to reset NCCL flight recorder" not in record.getMessage()


def local_tree(tree: Any) -> Any:
    """tree with every DTensor replaced by this rank's shard of it."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(v) for v in tree)
    return tree


def _hostname() -> str:

    return socket.gethostname()
