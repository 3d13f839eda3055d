"""Context-parallel scaling on CPU: activation memory and communication per rank for cp = 1, 2, 4.

One forward + backward of a 2-layer debugmodel on one sequence of SEQ_LEN tokens. cp = 1 is
the plain model in this process; cp > 1 applies `apply_cp` on that many spawned gloo processes.

  activations: bytes of the tensors autograd saves for backward (parameters excluded), counted
               once per storage, on one rank. Above 1/cp of cp=1 by the gathered K and V and,
               on CPU, the lower-right causal masks that SDPA materialises and saves;
  all-gather / reduce-scatter: bytes each rank receives in the forward all-gather of K and V and
               in the backward reduce-scatter of their gradients, counted from the functional
               collectives seen by CommDebugMode, beside the theory
               (cp − 1)/cp · S · n_kv_heads · head_dim · 2 (K and V) · bytes per element · layers.

Run from the repository root: python -m benchmarks.cp_scaling
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from weft.components.distributed.cpu_ranks import run_distributed
from weft.models import spec_for_flavor
from weft.parallelisms.cp import apply_cp, shard_sequence

SEQ_LEN = 1024
BATCH = 1
CP_DEGREES = (1, 2, 4)
LLAMA = spec_for_flavor("debugmodel")
ARGS = replace(LLAMA.flavors["debugmodel"], n_layers=2)
MiB = 2**20

# CommDebugMode tracks modules with full backward hooks, which warn when the inputs need no grad.
warnings.filterwarnings("ignore", message="Full backward hook is firing")

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor


class CommBytesMode(CommDebugMode):
    """CommDebugMode that also adds up the bytes this rank receives in each functional collective.

    With a ring algorithm over n ranks, an all-gather of an input of B bytes delivers (n − 1)·B
    bytes to each rank, and a reduce-scatter of B bytes delivers (n − 1)/n · B.
    """

    def __init__(self) -> None:
        super().__init__()
        self.received_bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "_overloadpacket", None)
        if packet is _ALL_GATHER:
            tensor, group_size = args[0], args[1]
            self.received_bytes["all_gather"] += (group_size - 1) * tensor.nbytes
        elif packet is _REDUCE_SCATTER:
            tensor, group_size = args[0], args[2]
            self.received_bytes["reduce_scatter"] += (group_size - 1) * tensor.nbytes // group_size
        return super().__torch_dispatch__(func, types, args, kwargs)


def measure_step(cp_mesh: DeviceMesh | None) -> dict[str, int]:
    """One forward + backward of the model (context-parallel over cp_mesh if given): bytes on this rank."""
    model = LLAMA.build(ARGS)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    positions = None
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
        (tokens, labels), positions = shard_sequence(cp_mesh, tokens, labels)

    state = [*model.parameters(), *model.buffers()]
    not_activations = {t.untyped_storage().data_ptr() for t in state}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in not_activations:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    comm = CommBytesMode()
    with comm:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = model(tokens, positions)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    return {"activations": sum(saved.values()), "collectives": comm.get_total_counts(), **comm.received_bytes}


def _cp_worker() -> dict[str, int]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    return measure_step(mesh)


def theoretical_kv_bytes(cp: int) -> float:
    """Bytes each rank receives per step when all-gathering K and V (or reduce-scattering their grads)."""
    per_layer = BATCH * SEQ_LEN * ARGS.kv_heads * ARGS.head_dim * 2 * torch.float32.itemsize
    return (cp - 1) / cp * per_layer * ARGS.n_layers


def main() -> None:
    """Measure every CP degree and print one table."""
    torch.set_num_threads(1)
    results = {1: measure_step(None)}
    for cp in CP_DEGREES[1:]:
        # Ranks move equal bytes but save masks of different sizes: report the one that saves most.
        results[cp] = max(run_distributed(_cp_worker, cp), key=lambda r: r["activations"])
    baseline = results[1]["activations"]
    print(
        f"debugmodel, {ARGS.n_layers} layers, batch {BATCH}, seq_len {SEQ_LEN}, fp32, "
        f"{ARGS.n_heads} query / {ARGS.kv_heads} key-value heads of {ARGS.head_dim}; per rank, MiB"
    )
    header = ("cp", "activations", "vs cp=1", "1/cp", "all-gather", "theory", "reduce-scatter", "theory",
              "collectives")
    print("".join(f"{h:>15}" for h in header))
    for cp, r in results.items():
        theory = theoretical_kv_bytes(cp) / MiB
        row = (
            cp,
            f"{r['activations'] / MiB:.2f}",
            f"{r['activations'] / baseline:.3f}",
            f"{1 / cp:.3f}",
            f"{r.get('all_gather', 0) / MiB:.2f}",
            f"{theory:.2f}",
            f"{r.get('reduce_scatter', 0) / MiB:.2f}",
            f"{theory:.2f}",
            r["collectives"],
        )
        print("".join(f"{str(c):>15}" for c in row))


if __name__ == "__main__":
    main()
