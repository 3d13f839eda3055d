"""Muon (Newton–Schulz orthogonalised momentum) on the hidden matrices, AdamW on every other parameter.

One torch Optimizer holding both kinds of group, so the schedule, clipping and the DCP checkpoint
see one optimizer. Sharded (DTensor) matrices are orthogonalised whole: each rank gathers the
update, runs Newton–Schulz and keeps its own shard; stacked MoE experts ([E, out, in]) are
orthogonalised expert by expert, each rank on the experts it holds; attention optionally head by head. Numerically the update of
torch.optim.Muon, whose defaults and coefficients these are (torch/optim/_muon.py).
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients, 5 steps, its epsilon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")
# Modules whose weights are the model's ends (input embedding, output layer): AdamW's, as in the Muon papers.
END_MODULES = ("output", "lm_head")


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalised form of matrix `g` by torch.optim.Muon's quintic iteration, computed in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning rate for one [rows, cols] matrix: Keller Jordan's sqrt(max(1, rows/cols)),
    or Moonlight's 0.2 sqrt(max(rows, cols)) that matches AdamW's update RMS."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def muon_parameters(model: nn.Module, exclude: list[str] = ()) -> tuple[list[str], list[str]]:
    """(Muon's, AdamW's) trainable parameter names: Muon takes 2-D matrices and 3-D stacks of expert
    matrices, except embeddings, the output layer and names matching an `exclude` pattern (fnmatch)."""
    ends = {id(p) for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) or name.rsplit(".", 1)[-1] in END_MODULES for p in m.parameters()}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        takes = p.ndim in (2, 3) and id(p) not in ends and not any(fnmatch.fnmatch(name, pat) for pat in exclude)
        (muon if takes else adamw).append(name)
    return muon, adamw


def head_blocks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{name: (dim, head_dim)} of attention's projections, to orthogonalise head by head: wq, wk and wv
    split along their rows (dim 0), wo along its columns (dim 1); any module with an int `head_dim`
    and linears wq, wk, wv, wo (weft's attention)."""
    blocks = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "head_dim", None), int):
            for proj, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
                if isinstance(getattr(m, proj, None), nn.Linear):
                    blocks[f"{name}.{proj}.weight"] = (dim, m.head_dim)
    return blocks


class Muon(torch.optim.Optimizer):
    """Muon on `muon_params` (torch.optim.Muon's step, Newton–Schulz in `ns_dtype`), and torch's AdamW with
    `adamw` keyword arguments on `adamw_params`, sharing this optimizer's state and param_groups.
    `blocks`: {id(parameter): (dim, size)} of matrices orthogonalised in blocks of `size` along `dim` (heads);
    `owner_ranks`: a sharded 2-D matrix's Newton–Schulz runs on one owner rank, its result scattered back."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter], *, lr: float,
                 momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.1, ns_steps: int = NS_STEPS,
                 adjust_lr_fn: str = "original", ns_dtype: torch.dtype = torch.bfloat16, adamw: dict | None = None,
                 blocks: dict[int, tuple[int, int]] | None = None, owner_ranks: bool = False):
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn: expected one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        for p in muon_params:
            if p.ndim not in (2, 3):
                raise ValueError(f"Muon takes matrices and stacks of them; got a parameter of shape {tuple(p.shape)}")
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
                    "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "use_muon": True}
        super().__init__([{"params": muon_params}], defaults)
        self.ns_dtype, self.blocks, self.owner_ranks = ns_dtype, blocks or {}, owner_ranks
        self.adamw = torch.optim.AdamW(adamw_params, **(adamw or {})) if adamw_params else None
        self._link_adamw()

    def _link_adamw(self) -> None:
        """The AdamW groups are this optimizer's own (the schedule scales them; a checkpoint holds them)."""
        if self.adamw is None:
            return
        groups = [g for g in self.param_groups if not g.get("use_muon", False)]
        if not groups:  # at construction: AdamW's groups join this optimizer's
            self.param_groups.extend(self.adamw.param_groups)
            groups = self.adamw.param_groups
        self.adamw.param_groups = groups
        self.adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: AdamW points at them again
        self._link_adamw()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("use_muon", False):
                self._muon_group(group)
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            block = self.blocks.get(id(p))
            update = self.orthogonalise(update, group["ns_steps"], block, index if self.owner_ranks else None)
            shape = list(p.shape[-2:])
            if block is not None:
                shape[block[0]] = block[1]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], *shape))

    def orthogonalise(self, update: torch.Tensor, steps: int, block: tuple[int, int] | None = None,
                      owner: int | None = None) -> torch.Tensor:
        """Newton–Schulz of each whole matrix of `update`, returned in its layout; a DTensor is gathered
        whole, or for stacked experts only to the experts this rank holds (its shards of dim 0 kept).
        `owner` (a 2-D DTensor): only the ranks at mesh coordinate owner % (smallest mesh dim) on every
        dim compute; distribute_tensor scatters their result."""
        if not isinstance(update, DTensor):
            return self._each_matrix(update, steps, block)
        keep = [pl if update.ndim == 3 and isinstance(pl, Shard) and pl.dim == 0 else Replicate()
                for pl in update.placements]
        whole = update.redistribute(update.device_mesh, keep)
        mesh = update.device_mesh
        if owner is not None and update.ndim == 2:
            source = owner % min(mesh.shape)
            if all(mesh.get_local_rank(d) == source for d in range(mesh.ndim)):
                done = self._each_matrix(whole.to_local(), steps, block)
            else:
                done = torch.empty(update.shape, dtype=update.dtype, device=whole.to_local().device)
            return distribute_tensor(done, mesh, update.placements, src_data_rank=source)
        done = self._each_matrix(whole.to_local(), steps, block)
        done = DTensor.from_local(done, update.device_mesh, keep, shape=update.shape, stride=update.stride())
        return done.redistribute(update.device_mesh, update.placements)

    def _each_matrix(self, update: torch.Tensor, steps: int, block: tuple[int, int] | None) -> torch.Tensor:
        if block is not None:
            dim, size = block
            return torch.cat([self._each_matrix(b, steps, None) for b in update.split(size, dim)], dim)
        if update.ndim == 2:
            return newton_schulz(update, steps, self.ns_dtype).to(update.dtype)
        return torch.stack([newton_schulz(m, steps, self.ns_dtype) for m in update]).to(update.dtype) \
            if len(update) else update.clone()
