"""The N-D device mesh: how the world's ranks split into pipeline, data, context and tensor parallel groups.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp; ep regroups dp_shard × cp × tp as
(dp_shard_mod_ep, ep), adding no rank. The flattened groups the transforms need, within a stage:

    dp           = dp_replicate × dp_shard        ranks that read different data
    dp_shard_cp  = dp_shard × cp                  ranks that shard parameters (FSDP)
    dp_cp        = dp_replicate × dp_shard × cp   ranks whose losses are averaged
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from weft.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the (flattened) sub-meshes each transform works on."""

    dims: "ParallelDims"
    world: DeviceMesh
    dp: DeviceMesh  # data loading: dp_replicate × dp_shard
    dp_cp: DeviceMesh  # loss averaging: dp_replicate × dp_shard × cp
    fsdp: DeviceMesh  # parameter sharding: dp_shard × cp, or 2-D (dp_replicate, dp_shard × cp) for HSDP
    dp_replicate: DeviceMesh  # DDP
    cp: DeviceMesh
    tp: DeviceMesh
    pp: DeviceMesh  # pipeline stages: the ranks that hold the same shard of different stages
    ep: DeviceMesh | None = None  # expert parallelism: ranks holding different experts (ep > 1)
    expert_fsdp: DeviceMesh | None = None  # FSDP of the experts: dp_shard_mod_ep, ranks with the same experts
    routing: DeviceMesh | None = None  # ranks whose MoE routing counts are summed: dp_cp, × tp under ep with tp


class LayoutError(UserError):
    """A parallel layout that cannot run; the message is one line with the numbers."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    pp: int = 1
    ep: int = 1

    @classmethod
    def resolve(
        cls, *, world_size: int, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1,
        ep: int = 1,
    ) -> "ParallelDims":
        """Fill in dp_shard = -1 as 'the rest of the world' and check the layout multiplies out."""
        for name, degree in (("pp", pp), ("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("ep", ep)):
            if degree < 1:
                raise LayoutError(f"parallelism.{name} must be >= 1, got {degree}")
        if world_size % pp:
            raise LayoutError(f"parallelism.pp = {pp} does not divide the world size {world_size}")
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others:
                raise LayoutError(
                    f"world size {world_size} is not divisible by {_product_text(pp=pp, dp_replicate=dp_replicate, cp=cp, tp=tp)}, "
                    "so parallelism.dp_shard = -1 cannot fill it"
                )
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise LayoutError(f"parallelism.dp_shard must be -1 or >= 1, got {dp_shard}")
        if pp * dp_replicate * dp_shard * cp * tp != world_size:
            raise LayoutError(
                f"{_product_text(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)} does not equal the world size {world_size}"
            )
        if ep > 1 and ((dp_shard * cp * tp) % ep or ep % tp):
            raise LayoutError(f"parallelism.ep = {ep} must divide dp_shard·cp·tp = {dp_shard}·{cp}·{tp} = "
                              f"{dp_shard * cp * tp} and be a multiple of tp = {tp}: expert parallelism borrows "
                              "its ranks from FSDP's and tensor parallelism's")
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size, pp=pp, ep=ep)

    def check_seq_len(self, seq_len: int) -> None:
        """Reject sequence lengths the layout cannot split (the model's own shape is checked by
        the transforms themselves)."""
        if seq_len % (2 * self.cp) and self.cp > 1:
            raise LayoutError(
                f"context parallelism needs training.seq_len divisible by 2·cp = {2 * self.cp}, got {seq_len}"
            )
        if self.tp > 1 and (seq_len // self.cp) % self.tp:
            raise LayoutError(
                f"sequence parallelism needs training.seq_len / cp = {seq_len // self.cp} divisible by "
                f"tp = {self.tp}"
            )

    @property
    def dp(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: dp_replicate > 1 with nothing to shard over."""
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def stage_world_size(self) -> int:
        """Ranks that hold one pipeline stage between them (the whole world without pipelining)."""
        return self.world_size // self.pp

    def build_mesh(self, device_type: str) -> "Meshes":
        """The world mesh with its five named dims, and the flattened meshes the transforms use."""
        world = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
        )
        dp_cp = world[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
        dp_shard_cp = world[("dp_shard", "cp")]._flatten("dp_shard_cp")
        # HSDP shards inside a replica and all-reduces across replicas: a 2-D (replicate, shard) mesh.
        hsdp = dp_cp._unflatten(0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp"))
        experts = routing = None
        if self.ep > 1:  # the ranks of dp_shard × cp × tp (tp innermost), regrouped
            borrowed = dp_shard_cp if self.tp == 1 else world[("dp_shard", "cp", "tp")]._flatten("dp_shard_cp_tp")
            experts = borrowed._unflatten(0, (borrowed.size() // self.ep, self.ep), ("dp_shard_mod_ep", "ep"))
            if self.tp > 1:  # every tp rank routes its own tokens: the routing counts are summed over tp too
                routing = world[("dp_replicate", "dp_shard", "cp", "tp")]._flatten("dp_cp_tp")
        return Meshes(
            dims=self,
            world=world,
            dp=world[("dp_replicate", "dp_shard")]._flatten("dp"),
            dp_cp=dp_cp,
            fsdp=hsdp if self.dp_replicate > 1 else dp_shard_cp,
            dp_replicate=world["dp_replicate"],
            cp=world["cp"],
            tp=world["tp"],
            pp=world["pp"],
            ep=experts["ep"] if experts is not None else None,
            expert_fsdp=experts["dp_shard_mod_ep"] if experts is not None else None,
            routing=routing if routing is not None else dp_cp,
        )

    def describe(self) -> str:
        return (
            (f"pp={self.pp} " if self.pp > 1 else "") + f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} "
            + (f"ep={self.ep} " if self.ep > 1 else "") + f"(world size {self.world_size})"
        )


def _product_text(**degrees: int) -> str:
    """'dp_replicate·dp_shard·cp·tp = 1·3·1·1 = 3'; pp is named only when it is used."""
    if degrees.get("pp") == 1:
        del degrees["pp"]
    product = 1
    for degree in degrees.values():
        product *= degree
    return f"{'·'.join(degrees)} = {'·'.join(map(str, degrees.values()))} = {product}"
