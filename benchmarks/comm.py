"""Collectives of one training step, measured on CPU / gloo and set beside what the parallel plan predicts.

For each layout below, every rank builds the debug model exactly as train.py does (tensor
parallelism, then FSDP, then materialise and initialise), runs ONE training step (forward,
backward, gradient clipping, AdamW step, loss average) in fp32, and records every collective it
issues: the c10d ops FSDP2 and the training loop call (`torch.ops.c10d.*`) and the functional
collectives DTensor calls (`torch.ops._c10d_functional.*`). The theory is derived from the model
shape and from what parallelisms/fsdp.py and parallelisms/tp.py ask FSDP2 and DTensor to do.

Bytes are per rank, in this convention (the logical size of the collective, not the bytes a
given algorithm puts on the wire):
    all_gather      bytes of the gathered output (group size × the input)
    reduce_scatter  bytes of the input (group size × the output)
    all_reduce      bytes of the tensor
    others          bytes of the input

Run from the repository root:  OMP_NUM_THREADS=1 python benchmarks/comm.py
Exit code 0 when every layout's measurement matches its theory, 1 otherwise.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from weft.components.config import Optimizer, parse_args
from weft.components.data import Batch
from weft.components.distributed.cpu_ranks import run_distributed
from weft.components.distributed.processes import all_reduce_mean
from weft.models import flavors
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import train_step

ARGS = flavors()["debugmodel"]
BATCH = 2  # local batch: samples per data-parallel rank
SEQ = 32
MAX_NORM = 1.0  # train.py's default gradient clipping
TOLERANCE = 0.05
OPTIMIZER = Optimizer(implementation="fused")  # train.py's "auto" on CPU and CUDA; the theory depends on it
FP32 = 4  # bytes per element: no mixed precision, so every collective moves fp32


@dataclass(frozen=True)
class Layout:
    dp_shard: int
    tp: int
    reshard_after_forward: str = "default"  # parallelism.fsdp_reshard_after_forward

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.tp

    @property
    def name(self) -> str:
        parts = [f"fsdp {self.dp_shard}"] if self.dp_shard > 1 else []
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        name = " × ".join(parts)
        return f"{name} (reshard_after_forward={self.reshard_after_forward})" if self.dp_shard > 1 else name


LAYOUTS = (
    Layout(dp_shard=2, tp=1),
    Layout(dp_shard=2, tp=1, reshard_after_forward="always"),
    Layout(dp_shard=2, tp=1, reshard_after_forward="never"),
    Layout(dp_shard=4, tp=1),
    Layout(dp_shard=1, tp=2),
    Layout(dp_shard=2, tp=2),
)

PHASES = ("forward", "backward", "step")
Key = tuple[str, str, str]  # (phase, collective, group: "dp" or "tp")
Traffic = tuple[int, int]  # (count, bytes per rank)

# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------

_c10d, _funcol, _funcol_autograd = torch.ops.c10d, torch.ops._c10d_functional, torch.ops._c10d_functional_autograd

# Each collective op: (kind, argument whose bytes are counted, whether to multiply by the group
# size). Functional all-gathers return their output, so the input times the group size is it.
_COLLECTIVES: dict[torch._ops.OpOverloadPacket, tuple[str, str, bool]] = {
    _c10d._allgather_base_: ("all_gather", "output_tensor", False),
    _c10d.allgather_: ("all_gather", "output_tensors", False),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", "outputs", False),
    _c10d._reduce_scatter_base_: ("reduce_scatter", "input_tensor", False),
    _c10d.reduce_scatter_: ("reduce_scatter", "input_tensors", False),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", "inputs", False),
    _c10d.allreduce_: ("all_reduce", "tensors", False),
    _c10d.allreduce_coalesced_: ("all_reduce", "tensors", False),
    _c10d.broadcast_: ("broadcast", "tensors", False),
    _c10d.alltoall_base_: ("all_to_all", "input", False),
    _funcol.all_gather_into_tensor: ("all_gather", "input", True),
    _funcol.all_gather_into_tensor_out: ("all_gather", "input", True),
    _funcol.all_gather_into_tensor_coalesced: ("all_gather", "inputs", True),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", "input", False),
    _funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", "inputs", False),
    _funcol.all_reduce: ("all_reduce", "input", False),
    _funcol.all_reduce_: ("all_reduce", "input", False),
    _funcol.all_reduce_coalesced: ("all_reduce", "inputs", False),
    _funcol.all_reduce_coalesced_: ("all_reduce", "inputs", False),
    _funcol.all_to_all_single: ("all_to_all", "input", False),
    _funcol.broadcast: ("broadcast", "input", False),
    _funcol.broadcast_: ("broadcast", "input", False),
    _funcol_autograd.all_gather_into_tensor: ("all_gather", "input", True),
    _funcol_autograd.reduce_scatter_tensor: ("reduce_scatter", "input", False),
    _funcol_autograd.all_to_all_single: ("all_to_all", "input", False),
}
# Ops of the collective namespaces that move no data: waiting on a result, wrapping it for autograd.
_NOT_COLLECTIVES = {_funcol.wait_tensor, _funcol._wrap_tensor_autograd}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}


def _nbytes(value: object) -> int:
    """Bytes of a tensor, or of all tensors in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective op this rank issues, and its bytes, by (phase, kind, group).

    `set_phase` is train_step's on_phase hook: the phase moves on with the step. Ops of the collective namespaces that are
    not in the table are counted too, under their own name with 0 bytes, so nothing goes unseen.
    """

    def __init__(self, group_labels: dict[str, str]) -> None:
        super().__init__()
        self.group_labels = group_labels
        self.phase = PHASES[0]
        self.traffic: dict[Key, list[int]] = defaultdict(lambda: [0, 0])

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A mode sees an op before tensor subclasses do, and is switched off while it runs one.
        # Hand DTensor ops on to DTensor, so the collectives it issues come back here as plain ops.
        if DTensor in types:
            return NotImplemented
        if func.namespace in _COLLECTIVE_NAMESPACES and func._overloadpacket not in _NOT_COLLECTIVES:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        kind, counted, times_group_size = _COLLECTIVES.get(func._overloadpacket, (str(func), "", False))
        nbytes = _nbytes(bound.get(counted)) * (bound["group_size"] if times_group_size else 1)
        entry = self.traffic[(self.phase, kind, self._group_label(bound))]
        entry[0] += 1
        entry[1] += nbytes

    def _group_label(self, bound: dict) -> str:
        if "group_name" in bound:  # functional collectives name their group
            name = bound["group_name"]
        elif "process_group" in bound:  # c10d ops carry the ProcessGroup itself, as a TorchScript object
            name = dist.ProcessGroup.unbox(bound["process_group"]).group_name
        else:
            return "?"
        return self.group_labels.get(name, f"group {name}")


def layout_plan(layout: Layout, args: Any, world_size: int) -> RunPlan:
    """train.py's plan for this layout: the debug config at BATCH x SEQ, fp32 everywhere,
    activation checkpointing and compile off (as by default: they add no collective of their own)."""
    cfg = parse_args([
        "--job.config_file", "debug_model", "--training.local_batch_size", str(BATCH), "--training.seq_len", str(SEQ),
        "--parallelism.dp_shard", str(layout.dp_shard), "--parallelism.tp", str(layout.tp),
        "--parallelism.fsdp_reshard_after_forward", layout.reshard_after_forward,
        "--training.mixed_precision_param", "float32", "--training.max_norm", str(MAX_NORM),
        "--optimizer.implementation", OPTIMIZER.implementation,
    ])
    plan = RunPlan.from_config(cfg, world_size, device_type="cpu", check_environment=False)
    return replace(plan, model_args=args)


def measure(layout: Layout, args: Any = ARGS) -> dict[Key, Traffic]:
    """Worker: one step of train.py's own `train_step` and the logged-loss average; the collectives
    this rank issued."""
    # DTensor warns that the grad-norm all-reduces over (dp, tp) run one per mesh dim; the theory
    # counts them, the warning would only bury the tables.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    plan = layout_plan(layout, args, dist.get_world_size())
    meshes = plan.dims.build_mesh("cpu")
    device = torch.device("cpu")
    setup = build_trainer(plan, meshes, device).step

    # Every rank of one data-parallel replica (its TP ranks) reads the same batch.
    generator = torch.Generator().manual_seed(meshes.dp.get_local_rank())
    inputs = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=generator)

    # Name the process groups as the theory does. Without cp and dp_replicate, FSDP's mesh and the
    # loss-averaging mesh both span the data-parallel ranks: "dp".
    group_labels = {meshes.dp_cp.get_group().group_name: "dp", meshes.fsdp.get_group().group_name: "dp",
                    meshes.tp.get_group().group_name: "tp"}
    counter = CollectiveCounter(group_labels)
    with counter:
        result = train_step(setup, [Batch(inputs, labels)], on_phase=counter.set_phase)
        all_reduce_mean(result.loss, setup.loss_group)  # the logged loss
    return {key: (count, nbytes) for key, (count, nbytes) in counter.traffic.items()}


# ---------------------------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    phase: str
    op: str
    group: str
    count: int
    bytes: int  # per rank, all `count` collectives together
    why: str
    avoidable: bool = False  # weft (or DTensor under weft's plan) issues it, but need not

    @property
    def key(self) -> Key:
        return (self.phase, self.op, self.group)


Weight = tuple[tuple[int, ...], int | None]  # (global shape, dim tensor parallelism splits or None)


def block_weights(a: Any) -> list[Weight]:
    """The weights of one transformer block, placed as parallelisms/tp.py places them."""
    q, kv, hidden, d = a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim, a.dim
    return [
        ((q, d), 0), ((kv, d), 0), ((kv, d), 0),  # wq, wk, wv: ColwiseParallel splits output features
        ((d, q), 1),  # wo: RowwiseParallel splits input features
        ((hidden, d), 0), ((d, hidden), 1), ((hidden, d), 0),  # w1, w2, w3
        ((d,), None), ((d,), None),  # attention_norm, ffn_norm: SequenceParallel replicates them
    ]


def root_weights(a: Any) -> list[Weight]:
    """The weights outside the blocks: FSDP's root unit."""
    weights: list[Weight] = [((a.vocab_size, a.dim), 0), ((a.dim,), None)]  # tok_embeddings (by vocab), norm
    if not a.tie_embeddings:
        weights.append(((a.vocab_size, a.dim), 0))  # output, split by vocabulary
    return weights


def fsdp_unit_bytes(weights: list[Weight], tp: int, fsdp: int) -> int:
    """Bytes one all-gather (or gradient reduce-scatter) of an FSDP unit moves per rank.

    FSDP2 shards each parameter's TP-local tensor along dim 0 and pads dim 0 up to a multiple of
    the FSDP degree, so every rank holds an equal piece; all-gather output and reduce-scatter
    input are the padded TP-local tensors.
    """
    numel = 0
    for shape, tp_dim in weights:
        local = list(shape)
        if tp_dim is not None:
            local[tp_dim] //= tp
        local[0] = math.ceil(local[0] / fsdp) * fsdp
        numel += math.prod(local)
    return numel * FP32


def theory(layout: Layout, args: Any = ARGS, batch: int = BATCH, seq: int = SEQ,
           optimizer_implementation: str = OPTIMIZER.implementation) -> list[Expected]:
    """The collectives of one training step of `layout`, per rank."""
    fsdp, tp, n_layers = layout.dp_shard, layout.tp, args.n_layers
    n_tensors = len(block_weights(args)) * n_layers + len(root_weights(args))
    expected: list[Expected] = []

    if fsdp > 1:
        # apply_fsdp makes each block an FSDP unit and the root (embeddings, final norm, output)
        # another; each unit is all-gathered once before its forward and its gradients
        # reduce-scattered once after its backward.
        block = fsdp_unit_bytes(block_weights(args), tp, fsdp)
        root = fsdp_unit_bytes(root_weights(args), tp, fsdp)
        units = n_layers + 1
        expected += [
            Expected("forward", "all_gather", "dp", units, n_layers * block + root,
                     f"params of each FSDP unit: {n_layers} blocks + root"),
            Expected("backward", "reduce_scatter", "dp", units, n_layers * block + root,
                     "grads of each FSDP unit, same padded sizes as the params"),
        ]
        # Units resharded after forward are gathered again for their backward. apply_fsdp:
        # "default" reshards every block but the last (its backward comes first) and not the
        # root; "always" reshards all of them, root included (it passes True explicitly, which
        # overrides FSDP2's own rule of keeping the root gathered); "never" reshards none.
        regathered_blocks = {"default": n_layers - 1, "always": n_layers, "never": 0}[layout.reshard_after_forward]
        regathered_root = layout.reshard_after_forward == "always"
        if regathered_blocks or regathered_root:
            expected.append(Expected(
                "backward", "all_gather", "dp", regathered_blocks + regathered_root,
                regathered_blocks * block + regathered_root * root,
                f"params of units resharded after forward: {regathered_blocks} blocks"
                + (" + root" if regathered_root else ""),
            ))

    if tp > 1:
        # Sequence parallelism keeps the residual stream split by tokens: [batch, seq/tp, dim]
        # per rank. Every switch between that and the full sequence moves one activation.
        act = batch * seq * args.dim * FP32  # gathered output / reduce-scatter input
        expected += [
            # Forward. PrepareModuleInput gathers the tokens at the entrance of attention and of
            # the feed-forward (Shard(1) -> Replicate); the output projection's input_layouts=Shard(1)
            # gathers them once more before the vocabulary-split logits.
            Expected("forward", "all_gather", "tp", 2 * n_layers + 1, (2 * n_layers + 1) * act,
                     "tokens into attention and feed-forward of each block, and into output"),
            # wo and w2 (RowwiseParallel, output Shard(1)) leave partial sums, reduce-scattered
            # back to sequence shards; so does the vocabulary-split embedding, whose lookup is
            # partial (rows of other ranks read as zero) and whose output is Shard(1).
            Expected("forward", "reduce_scatter", "tp", 2 * n_layers + 1, (2 * n_layers + 1) * act,
                     "partial outputs of wo and w2 in each block, and of the embedding"),
            # loss_parallel's cross-entropy on vocabulary-sharded logits: max and sum of exp of
            # log-softmax, and the target's logit (held by one rank), each one float per token.
            Expected("forward", "all_reduce", "tp", 3, 3 * batch * seq * FP32,
                     "loss parallel: logits max, sum of exp, target logit"),
            # Backward mirrors each redistribution: the gradient of a gathered (replicated)
            # activation is partial, so it is reduce-scattered back to Shard(1) ...
            Expected("backward", "reduce_scatter", "tp", 2 * n_layers + 1, (2 * n_layers + 1) * act,
                     "grads of the gathered inputs of attention, feed-forward, output"),
            # ... and the gradient of a reduce-scattered output arrives Shard(1) and is gathered
            # for the matmul / embedding backward (the backward of Partial is Replicate).
            Expected("backward", "all_gather", "tp", 2 * n_layers + 1, (2 * n_layers + 1) * act,
                     "grads of the outputs of wo, w2, embedding"),
        ]
        # The RMSNorm weights are replicated over tp but see only their rank's tokens, so their
        # gradients come out of backward as Partial (sum pending) DTensors: 2 per block + final.
        n_norms = 2 * n_layers + 1
        norm_grad = args.dim * FP32
        if fsdp > 1:
            # Before reduce-scattering, FSDP2 (FSDPParam._get_grad_inner_tensor) redistributes each
            # gradient to its parameter's tp placement, Replicate: one all-reduce per norm weight.
            expected.append(Expected("backward", "all_reduce", "tp", n_norms, n_norms * norm_grad,
                                     "RMSNorm weight grads: Partial -> Replicate"))
        else:
            # Without FSDP nothing resolves them: p.grad stays Partial and every DTensor op that
            # reads it with a Replicate operand all-reduces it again, and discards the result:
            # _foreach_norm in clip_grad_norm_, then AdamW's reads of the gradient: one for the
            # fused kernel (train.py's default on CPU and CUDA), three for foreach (_foreach_lerp_
            # for exp_avg, _foreach_addcmul_ for exp_avg_sq, which reads it twice). So 2 or 4
            # all-reduces where 1 would do. (Scaling by the clip coefficient keeps Partial.)
            uses = 2 if optimizer_implementation == "fused" else 4
            expected.append(Expected("step", "all_reduce", "tp", uses * n_norms, uses * n_norms * norm_grad,
                                     f"RMSNorm weight grads left Partial, reduced {uses}x each", avoidable=True))

    # Gradient clipping: torch's get_total_norm stacks one norm per gradient tensor; with sharded
    # gradients those norms are partial and the stacked vector is all-reduced (squares summed)
    # once over each mesh dim the gradients are split on: twice, one after the other, on 2-D.
    grad_dims = [group for group, degree in (("dp", fsdp), ("tp", tp)) if degree > 1]
    for group in grad_dims:
        expected.append(Expected("step", "all_reduce", group, 1, n_tensors * FP32,
                                 f"grad-norm: {n_tensors} per-tensor norms"))
    # The loss is normalised by the supervised tokens of the global batch (components/training/loss.py): one
    # float counted over the data-parallel ranks before the first forward.
    expected.append(Expected("forward", "all_reduce", "dp", 1, FP32, "supervised-token count of the global batch"))
    # train.py averages the logged loss over the data-parallel ranks with one c10d all-reduce of a
    # scalar; it is issued even when that group has a single rank (tp only).
    expected.append(Expected("step", "all_reduce", "dp", 1, FP32, "loss average for logging"))
    return expected


# ---------------------------------------------------------------------------------------------
# Comparison and report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    key: Key
    measured: Traffic
    expected: Traffic | None  # None: the theory predicts no such collective
    why: str
    avoidable: bool

    @property
    def ratio(self) -> float:
        if self.expected is None or self.expected[1] == 0:
            return math.inf if self.measured[1] else 1.0
        return self.measured[1] / self.expected[1]

    @property
    def ok(self) -> bool:
        return (self.expected is not None and self.measured[0] == self.expected[0]
                and abs(self.ratio - 1) <= TOLERANCE)


def compare(measured: dict[Key, Traffic], expected: list[Expected]) -> list[Row]:
    """One row per (phase, collective, group) seen or predicted, in phase order."""
    theory_of: dict[Key, list[Expected]] = defaultdict(list)
    for e in expected:
        theory_of[e.key].append(e)
    rows = []
    for key in sorted(set(measured) | set(theory_of), key=lambda k: (PHASES.index(k[0]), k[1], k[2])):
        lines = theory_of.get(key)
        total = (sum(e.count for e in lines), sum(e.bytes for e in lines)) if lines else None
        why = "; ".join(e.why for e in lines) if lines else "UNEXPECTED: no theory"
        rows.append(Row(key, measured.get(key, (0, 0)), total, why, any(e.avoidable for e in lines or [])))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [f"{'phase':<9}{'collective':<15}{'group':<6}{'count':>6}{'theory':>7}"
             f"{'measured B/rank':>16}{'theory B/rank':>14}{'ratio':>7}  why"]
    for r in rows:
        theory_count, theory_bytes = (str(r.expected[0]), f"{r.expected[1]:,}") if r.expected else ("-", "-")
        note = (" [avoidable]" if r.avoidable else "") + ("" if r.ok else "  <-- MISMATCH")
        lines.append(f"{r.key[0]:<9}{r.key[1]:<15}{r.key[2]:<6}{r.measured[0]:>6}{theory_count:>7}"
                     f"{r.measured[1]:>16,}{theory_bytes:>14}{r.ratio:>7.3f}  {r.why}{note}")
    return "\n".join(lines)


def run_layout(layout: Layout) -> bool:
    """Measure one layout on its ranks, print its table and verdict; True when it matches."""
    per_rank = run_distributed(measure, layout.world_size, layout)
    expected = theory(layout)
    print(f"\n== {layout.name}: {layout.world_size} ranks, local batch {BATCH}, seq {SEQ}, fp32 ==")
    print(format_table(compare(per_rank[0], expected)))
    ok = True
    for rank, measured in enumerate(per_rank):
        rows = compare(measured, expected)
        ok &= all(r.ok for r in rows)
        if rank and measured != per_rank[0]:
            print(f"rank {rank} differs from rank 0:\n{format_table(rows)}")
    print(f"verdict {layout.name}: {'OK' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    print(f"debugmodel: {ARGS.n_layers} layers, dim {ARGS.dim}, {ARGS.n_heads} heads / {ARGS.kv_heads} kv, "
          f"ffn {ARGS.ffn_hidden_dim}, vocab {ARGS.vocab_size}. One step: forward, backward, clip, AdamW.")
    print("bytes per rank: all_gather = gathered output, reduce_scatter = input, all_reduce = tensor")
    results = [run_layout(layout) for layout in LAYOUTS]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
