"""DiLoCo across replica groups, on torchft: each group trains alone for sync_steps steps, then
the groups average their pseudo-gradients through an outer Nesterov SGD (torchft's DiLoCo, hooked
on the optimizer's step); joining, healing and committing happen at those syncs. Its state (the
last sync's global weights, outer momentum, place in the window) is part of every checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from weft.components.checkpoint.checkpointer import saved_name
from weft.components.checkpoint.state import load_optimizer_state, optimizer_state, prefixed_names
from weft.components.config import JobConfig
from weft.components.ft.groups import ReplicaGroups, like_param, local_tree
from weft.components.training.moe_balance import moe_layers


class DiLoCoGroups(ReplicaGroups):
    """ReplicaGroups under semi_sync_method = diloco. model, optimizer and scheduler are the inner
    ones torchft's DiLoCo wraps: its hook on the optimizer joins the quorum and syncs every
    sync_steps steps; every inner step commits (a sync is committed or dropped as a whole)."""

    diloco = True
    _uncommitted_means = "; the sync window is dropped"

    def __init__(self, cfg: JobConfig, device: torch.device, state: tuple[Callable[[], dict], Callable[[dict], None]],
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler):
        from torchft.local_sgd import DiLoCo

        super().__init__(cfg, device, state, model, optimizer, scheduler)
        ft = cfg.fault_tolerance

        self._outer = torch.optim.SGD(model.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum,
                                      nesterov=ft.outer_nesterov)
        self._diloco = DiLoCo(self.manager, [model], optimizer, self._outer, sync_every=ft.sync_steps)
        self._diloco.__enter__()
        self._resumed: dict | None = None  # DiLoCo's state as a checkpoint held it (load_state_dict)
        self._syncs_at_join = self._training = False
        self._inner_at_join = 0  # steps into the sync window this group joins at
        self._peer: dict = {}  # what the peer this group healed from was doing (_state_for_peer)

    def steps(self, start_step: int, last_step: int) -> Iterator[int]:
        """The steps to train, alone between syncs. A fresh start syncs once at its join (a no-op: no
        group has moved yet) so that a group restarted afresh takes part in the live groups' next sync. A group
        resumed from a checkpoint goes on inside its sync window with the global weights and outer
        momentum it saved, and counts itself one sync behind what it saved: groups resumed together
        stay even and none syncs out of turn, while a live group ahead heals it at its next sync."""
        self.step, window, resumed = start_step, self.cfg.sync_steps, self._resumed
        syncs = 1 if resumed is None else max(resumed["syncs"] - 1, 0)
        self.manager.load_state_dict({"step": syncs, "batches_committed": 0})
        self._syncs_at_join = resumed is None
        self._inner_at_join = 0 if resumed is None else resumed["inner_steps"]
        self._diloco._local_step = 0  # (not yet: the empty step of a heal must not reach a sync)
        self._join()
        sync = self._syncs_at_join
        self._diloco._local_step = self._inner_at_join
        if self._healed_step is not None:  # the peer's state, and its place in the sync window
            self._diloco._local_step = self._peer["inner_steps"] % window  # (torch counted the empty step
            if self._peer["training"]:  # that set up the optimizer) the peer sent from inside its
                self._scheduler.step()  # optimizer step (DiLoCo syncs there), before its schedule's step
            sync = self._peer["training"] or self._peer["syncs_at_join"]
        if sync:  # the sync the live groups are in (all of them at a fresh start)
            self._diloco._fragments[0].prepare_sync()
            self._diloco._fragments[0].perform_sync()
        self._training = True
        while self.step < last_step:  # a heal inside a step (at a sync) moves self.step to the peer's
            self.step += 1
            self._healed_step = None
            yield self.step

    def _before_commit(self) -> Callable[[], None]:
        """At a sync, before its commit: what DiLoCo's sync of the parameters leaves
        out, in one all-reduce: the MoE layers' routing biases (buffers), averaged over the groups,
        and the config's hash (the check average_gradients makes every step). Returns what puts
        the averaged biases in place once the sync commits."""

        biases = [local_tree(layer.expert_bias) for _, layer in moe_layers(self._model)]
        flat = torch.cat([b.reshape(-1).float() for b in biases] + [torch.tensor([self.identity])])
        self.manager.allreduce(flat).wait()
        self._check_identity(flat[-1].item(), self.step)

        def apply() -> None:
            offset = 0
            for bias in biases:
                bias.copy_(flat[offset:offset + bias.numel()].view_as(bias))
                offset += bias.numel()

        return apply

    def should_commit(self) -> bool:
        self.committed = True
        return True

    def close(self) -> None:
        self._diloco.__exit__(None, None, None)
        super().close()

    def _state_for_peer(self) -> dict[str, Any]:
        where = {"training": self._training, "syncs_at_join": self._syncs_at_join,
                 "inner_steps": self._diloco._local_step if self._training else self._inner_at_join}
        return {**super()._state_for_peer(), "diloco": where}

    def _heal_from(self, state: dict[str, Any]) -> None:
        super()._heal_from(state)
        self._peer = state["diloco"]

    # DiLoCo's part of a checkpoint (Checkpointer.states["diloco"]): without it a resume would
    # start a new sync window from the local weights and lose the outer momentum.
    def state_dict(self) -> dict[str, Any]:
        """The global weights of the last sync (laid out as the model's, so that DCP reshards them),
        the outer optimizer (its momentum), the steps taken in this sync window, the syncs so far."""

        kept = self._diloco._fragments[0].original_parameters
        weights = {name: like_param(kept[raw], param) for raw, name, param in self._named_weights()}
        return {"global_weights": weights, "outer_optimizer": optimizer_state(self._model, self._outer),
                "inner_steps": self._diloco._local_step, "syncs": self.manager.current_step()}

    def load_state_dict(self, state: dict[str, Any]) -> None:

        kept = self._diloco._fragments[0].original_parameters
        with torch.no_grad():
            for raw, name, _ in self._named_weights():
                kept[raw].copy_(local_tree(state["global_weights"][name]))
        load_optimizer_state(self._model, self._outer, state["outer_optimizer"])
        self._resumed = {"inner_steps": state["inner_steps"], "syncs": state["syncs"]}

    def _named_weights(self) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
        """(DiLoCo's name, the checkpoint's name, parameter) of each weight DiLoCo syncs."""
        plain = {prefixed: name for name, prefixed in prefixed_names(self._model).items()}
        for raw, param in self._model.named_parameters():
            yield raw, saved_name(plain.get(raw, raw)), param
