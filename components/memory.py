"""Memory per device of one training step, estimated without a device: what the dry run prints.

Parameters, gradients and AdamW (or Muon) state are counted exactly from the parallelised meta model's
local shards; activations come from an analytic formula per block (`block_activation_bytes`: dense and
MoE blocks, expert parallelism, AC modes, float8, CP), transient buffers from FSDP's all-gathers
and reduce-scatters and from the logits and the loss (`loss_bytes`). The formula, what it leaves
out and how close it comes: docs/memory.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from weft.components.checkpoint.state import whole_model
from weft.components.training.loss import CHUNK_BYTES
from weft.components.training.muon import muon_parameters
from weft.layers import EXPERT_WEIGHTS
from weft.models import spec_for_args
from weft.parallelisms.common import transformer_blocks
from weft.parallelisms.fsdp import fsdp_shard_dim
from weft.parallelisms.lora import (
    NF4_BLOCK,
    expert_adapter_ids,
    lora_modules,
    nf4_scaler_block,
    stacked_experts,
)

GIB = 1024**3

# GPU names a user may give instead of a size, and the memory the device reports in GiB.
GPU_MEMORY_GIB = {
    "h100": 79.1, "h100-80gb": 79.1, "h200": 139.8, "a100": 79.1, "a100-80gb": 79.1, "a100-40gb": 39.4,
    "l40s": 44.4, "a6000": 47.5, "4090": 23.6, "rtx4090": 23.6, "3090": 23.6, "rtx3090": 23.6,
    "a10g": 22.1, "l4": 22.1, "v100": 31.7, "v100-16gb": 15.8, "t4": 14.6, "b200": 178.4,
    "mi300x": 191.5,
}


def device_memory_gib(text: str) -> float:
    """'80', '79.1' or a GPU name ('h100', 'a100-40gb', '4090') → GiB; raises ValueError."""
    name = text.strip().lower()
    if name in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[name]
    value = float(name.removesuffix("gib").removesuffix("gb"))
    if value <= 0:
        raise ValueError(text)
    return value


def measured_peak_bytes(fn) -> int:
    """Highest running total of CPU allocations (bytes) during fn(), relative to its start.

    torch's profiler with profile_memory=True records every allocation and free of the CPU
    allocator with its size; their running sum in time order is the memory fn() held on top of
    what existed before it. (On CUDA, torch.cuda.max_memory_allocated says the same directly.)"""

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(event):
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def training_state_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(parameters, gradients, AdamW state) bytes this rank holds, from the local shards.

    Gradients take the shape and dtype of the local parameter (FSDP casts reduced gradients back
    to the parameter dtype); AdamW keeps exp_avg and exp_avg_sq in fp32 (its 4-byte `step`
    counters are left out: a few hundred bytes)."""
    params = grads = optimizer = 0
    nf4 = nf4_planned_numel(model)
    for p in model.parameters():
        local = local_tensor(p)
        size = planned_nf4_bytes(local.numel(), nf4[id(p)]) if id(p) in nf4 else local.numel() * local.element_size()
        params += size
        if p.requires_grad:
            grads += size
            optimizer += 2 * local.numel() * 4
    return params, grads, optimizer


def muon_state_bytes(model: nn.Module, exclude: tuple[str, ...], ns_bytes: int) -> tuple[int, int]:
    """(optimizer state, step temporaries) bytes this rank holds under optimizer.name Muon: one fp32
    momentum per element of Muon's matrices, AdamW's two fp32 for the rest; at the step, the largest
    matrix gathered whole (stacked experts: the rank's experts) in fp32, its result in fp32, and three
    Newton-Schulz working copies in the Newton-Schulz dtype."""
    muon = set(muon_parameters(model, list(exclude))[0])
    state = largest = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        local = local_tensor(p)
        state += local.numel() * 4 * (1 if name in muon else 2)
        if name in muon:
            largest = max(largest, p.numel() if p.ndim == 2 else p.numel() // p.shape[0] * local.shape[0])
    return state, largest * (4 + 4 + 3 * ns_bytes)


def nf4_planned_weights(model: nn.Module) -> set[int]:
    """ids of the frozen LoRA base weights that QLoRA stores (or will store, on meta) in NF4: the
    targeted linears' weights and the stacked routed experts (quantized expert by expert)."""
    return set(nf4_planned_numel(model))


def nf4_planned_numel(model: nn.Module) -> dict[int, int]:
    """id of each weight QLoRA will store in NF4 → the values torchao quantizes in one go (the whole
    weight of a linear, one expert of a stack)."""
    planned = {id(m.weight): m.weight.numel() for _, m in lora_modules(model) if m.quantize_base == "nf4"}
    for _, module in stacked_experts(model):
        if getattr(module, "quantize_base", None) == "nf4":
            weights = [getattr(module, w) for w in EXPERT_WEIGHTS if isinstance(getattr(module, w), nn.Parameter)]
            planned.update({id(w): w[0].numel() for w in weights})
    return planned


def nf4_bytes(numel: int) -> int:
    """torchao's NF4: 4 bits a value, an int8 scale per 64 values, an fp32 factor per group of
    scales (up to 256, parallelisms.lora.nf4_scaler_block)."""
    return numel // 2 + numel // NF4_BLOCK + 4 * (numel // (NF4_BLOCK * nf4_scaler_block(numel)))


def planned_nf4_bytes(numel: int, quantized_numel: int) -> int:
    """NF4 bytes of `numel` values quantized `quantized_numel` at a time: a linear's weight whole,
    or a stack of experts (or a rank's share of them), each expert alone and its scales' mean
    (fp32) kept beside (layers/nf4_experts.py)."""
    if numel == quantized_numel:
        return nf4_bytes(numel)
    experts = max(numel // quantized_numel, 1)
    return experts * (nf4_bytes(quantized_numel) + 4)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class StepShape:
    """What decides activation memory: the model, the local tokens and the layout."""

    args: Any  # the model's hyper-parameters (its family's ModelArgs)
    local_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    fsdp: int = 1  # ranks sharing parameters (dp_shard · cp); 1: no FSDP
    ep: int = 1  # expert parallelism: ranks the routed experts are spread over (borrowed from fsdp)
    ep_imbalance: float = 1.0  # under ep: tokens the busiest rank's experts receive over the mean, planned for
    compute_dtype: torch.dtype = torch.bfloat16
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    ac_mode: str = "none"
    ac_option: str = "op"
    float8: bool = False
    loss_parallel: bool = True
    compiled_loss: bool = False  # components/training/loss.py: compiled cross-entropy, else chunked (eager)
    autocast: bool = False  # one device, bf16 by autocast: it caches a bf16 copy of every weight in forward
    foreach_optimizer: bool = False  # foreach AdamW: ~one fp32 temporary per parameter; fused: none
    muon_exclude: tuple[str, ...] | None = None  # optimizer.name Muon: its muon_exclude; None: AdamW
    muon_ns_bytes: int = 2  # Muon: bytes per element of its Newton-Schulz dtype
    lora_rank: int = 0  # LoRA on every block linear: frozen norms keep no output, adapters keep A x
    # A pipeline rank: local_batch is then one micro-batch; `blocks` the block activations (one block,
    # one micro-batch each) it holds at its peak (0: every block once), `blocks_with_gradients` those
    # it holds after backward has begun (beside the gradients; schedules that interleave forwards
    # and backwards), `in_flight` the micro-batches whose logits the last stage holds; only the
    # first stage has the embedding, only the last the output, its logits and the loss.
    blocks: int = 0
    blocks_with_gradients: int = 0
    in_flight: float = 1.0
    gathered_blocks: int = 2  # blocks FSDP holds unsharded at once: 2, or every one when it never reshards
    first_stage: bool = True
    last_stage: bool = True

    @property
    def tokens(self) -> int:
        """Tokens one rank's activations cover (before sequence parallelism): local batch × seq / cp."""
        return self.local_batch * self.seq_len // self.cp


def block_activation_bytes(s: StepShape) -> int:
    """Bytes autograd keeps for one block without activation checkpointing (the formula above)."""
    a, t, e, tp = s.args, s.tokens, dtype_bytes(s.compute_dtype), s.tp
    h, hq, hkv, f = a.dim, a.n_heads * a.head_dim // tp, a.kv_heads * a.head_dim // tp, a.ffn_hidden_dim // tp
    linear_in = 1 if s.float8 else e  # float8 linears save their input already cast
    # The norms keep their fp32 upcast and normed output (T/tp tokens); the linears after them keep
    # their input (the all-gathered one under tp > 1, so T tokens).
    norms = 2 * (t // tp) * h * (4 + e) + 2 * t * h * linear_in
    attention = t * e * (3 * hq + 2 * hkv) + (t * hq * (linear_in - e))
    feed_forward = t * f * (3 * e + linear_in)
    ring = 2 * t * s.cp * hkv * e if s.cp > 1 else 0
    # MoE layers: their experts' hidden activations follow the tokens a rank's experts receive
    # (under ep up to ep_imbalance × the rank's own), and the layer keeps two copies of each routed
    # token: gathered in expert order, and weighted by its score as the experts' input (under ep,
    # the input that arrived).
    received = s.ep_imbalance if s.ep > 1 else 1.0
    experts = spec_for_args(a).experts(a)
    routed_hidden, routed_slots = (experts.routed_hidden_dim, experts.routed_slots) if experts else (0, 0.0)
    feed_forward += int(t * (received - 1) * routed_hidden // tp * (3 * e + linear_in))
    routed_tokens = t // tp if s.ep > 1 else t  # under ep each tp rank routes its own sequence shard
    routed_copies = int(routed_tokens * routed_slots * h * e * (1 + received))
    # LoRA: a frozen norm weight needs no normed output for its gradient; each of the 7 adapters
    # keeps A x (T x rank) for B's gradient (their input x is the base linear's, kept above).
    lora = 7 * t * s.lora_rank * e - 2 * (t // tp) * h * e if s.lora_rank else 0
    return norms + attention + feed_forward + ring + routed_copies + lora


def block_selective_op_bytes(s: StepShape) -> int:
    """Selective "op": matmul outputs (q, k, v, wo, w1, w3, w2), the attention output, and the
    block input kept; the norms and element-wise ops recomputed."""
    a, t, e, tp = s.args, s.tokens, dtype_bytes(s.compute_dtype), s.tp
    h, hq, hkv, f = a.dim, a.n_heads * a.head_dim // tp, a.kv_heads * a.head_dim // tp, a.ffn_hidden_dim // tp
    kept = t * e * (2 * hq + 2 * hkv + 2 * h + 2 * f)
    reduce_scattered = 2 * (t // tp) * h * e if tp > 1 else 0
    return kept + reduce_scattered + block_input_bytes(s)


def block_input_bytes(s: StepShape) -> int:
    """What full AC keeps of a block: its input, the (sequence-parallel) residual stream."""
    return (s.tokens // s.tp) * s.args.dim * dtype_bytes(s.compute_dtype)


def activation_bytes(s: StepShape) -> tuple[int, int]:
    """(kept at the end of forward, extra while one checkpointed block is recomputed in backward)."""
    return blocks_activation_bytes(s, s.blocks or s.args.n_layers)


def blocks_activation_bytes(s: StepShape, n: int) -> tuple[int, int]:
    """activation_bytes for n block activations."""
    full = block_activation_bytes(s)
    if s.ac_mode == "none":
        return n * full, 0
    if s.ac_mode == "full":
        return n * block_input_bytes(s), full
    if s.ac_option == "op":
        return n * block_selective_op_bytes(s), full - block_selective_op_bytes(s)
    every = int(s.ac_option)
    checkpointed = (n + every - 1) // every
    return checkpointed * block_input_bytes(s) + (n - checkpointed) * full, full


def loss_bytes(s: StepShape) -> tuple[int, int, int]:
    """(logits, loss work in forward, loss work in backward) in bytes; see the module doc. A pipeline
    stage before the last has none; the last keeps the logits of each micro-batch in flight."""
    if not s.last_stage:
        return 0, 0, 0
    vocab = s.args.vocab_size // s.tp if s.tp > 1 and s.loss_parallel else s.args.vocab_size
    n, e = s.tokens * vocab, dtype_bytes(s.compute_dtype)
    if s.tp > 1 and s.loss_parallel:  # eager fp32 cross-entropy on the vocabulary shard
        return int(s.in_flight * n * e), n * 4, n * 8
    if s.compiled_loss:
        return int(s.in_flight * n * e), 0, n * e
    chunk = min(s.tokens, max(1, CHUNK_BYTES // (4 * vocab))) * vocab * 4
    return int(s.in_flight * n * e), 2 * chunk, n * e + chunk


@dataclass
class MemoryEstimate:
    """Bytes per device, by kind, and the total at each phase of a step."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    optimizer_kind: str = "AdamW, 2 x fp32"

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                (f"optimizer state ({self.optimizer_kind})", self.optimizer), ("activations (end of forward)", self.activations)]
        rows += [(name, size) for name, size in self.buffers.items()]
        scale, unit = (GIB, "GiB") if self.peak >= GIB else (1024**2, "MiB")  # the debug model is MiB-sized
        lines = [f"  {name:<44} {size / scale:9.2f} {unit}" for name, size in rows]
        lines += [f"  {'total ' + phase:<44} {size / scale:9.2f} {unit}"
                  + ("   <- peak" if phase == self.peak_phase else "") for phase, size in self.phases.items()]
        return "\n".join(lines)


def block_numel(args: Any) -> int:
    """Parameters of one transformer block of the model `args` describe (its `ModelSpec`)."""
    return spec_for_args(args).block_numel(args)


def trainable_block_numel(model: nn.Module, ep: int = 1) -> int:
    """Trainable parameters (LoRA's adapters, on whatever it targets: the routed experts' too) of a
    block, averaged over the blocks of the whole model; the experts' adapters are 1/ep here under
    expert parallelism, spread with their experts."""
    blocks = transformer_blocks(whole_model(model), "estimate_memory")
    adapters = expert_adapter_ids(whole_model(model))
    numel = sum(p.numel() // (ep if id(p) in adapters else 1)
                for block in blocks for p in block.parameters() if p.requires_grad)
    return numel // max(len(blocks), 1)


def tp_fsdp_state_bytes(model: nn.Module, tp: int, fsdp: int) -> tuple[int, int, int]:
    """`training_state_bytes` of rank 0 computed from the unparallelised `model`'s shapes, for layouts not
    built: tensor parallelism splits wq/wk/wv/w1/w3, the output and the embedding by rows and
    wo/w2 by columns (norms whole), FSDP then splits dim 0 of each local piece (rank 0 holds the
    ceil; stacked experts on more ranks than experts: their largest dim, `fsdp_shard_dim`). Checked against the real transforms in tests/components/test_memory.py. With LoRA (apply_lora on
    the meta `model`): frozen parameters count once, in their dtype or NF4; adapters (counted
    whole under tp, a slight overestimate) add fp32 gradients and AdamW state."""
    params = grads = 0
    nf4 = nf4_planned_numel(model)
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if tp > 1 and not name.endswith("norm.weight") and ".lora_" not in name:
            split = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
            shape[split] = -(-shape[split] // tp)
        if fsdp > 1:
            dim = 0 if tp > 1 else fsdp_shard_dim(shape, fsdp)  # apply_fsdp's rule; TP's DTensors keep 0
            shape[dim] = -(-shape[dim] // fsdp)
        numel = torch.Size(shape).numel()
        size = planned_nf4_bytes(numel, nf4[id(p)]) if id(p) in nf4 else numel * p.element_size()
        params += size
        grads += size if p.requires_grad else 0
    return params, grads, grads * 2  # trainable parameters are fp32: AdamW 2 x fp32 each


def routed_experts_per_block(model: nn.Module) -> int:
    """Parameters of the stacked routed experts, averaged over the blocks of the whole model (a
    pipeline rank's stages: of the model they were split from; 0 without experts)."""
    blocks = transformer_blocks(whole_model(model), "estimate_memory")
    routed = sum(p.numel() for block in blocks for _, m in stacked_experts(block)
                 for name, p in m.named_parameters(recurse=False) if name in EXPERT_WEIGHTS)
    return routed // max(len(blocks), 1)


def estimate_memory(model: nn.Module, s: StepShape, state: tuple[int, int, int] | None = None) -> MemoryEstimate:
    """The estimate for one rank of the parallelised meta-device `model` running steps of shape `s`
    (`state`: parameter, gradient and optimizer bytes if already known, else counted from `model`)."""
    params, grads, optimizer = state or training_state_bytes(model)
    step_temporaries, kind = (params if s.foreach_optimizer else 0), "AdamW, 2 x fp32"
    if s.muon_exclude is not None:
        muon_state, step_temporaries = muon_state_bytes(model, s.muon_exclude, s.muon_ns_bytes)
        optimizer = optimizer if state else muon_state  # state from shapes (the layouts table): AdamW's, an upper bound
        kind = "Muon 1 x fp32, AdamW 2 x fp32"
    if s.tp > 1 and s.fsdp == 1 and not s.args.tie_embeddings:
        # Measured (torch 2.13): without FSDP to reduce-scatter it, the gradient of the vocabulary-
        # split embedding comes back Replicate, so each rank holds the whole fp32 embedding gradient.
        vocab, dim = s.args.vocab_size, s.args.dim
        grads += (vocab - vocab // s.tp) * dim * 4
    kept, recompute = activation_bytes(s)
    logits, loss_forward, loss_backward = loss_bytes(s)
    buffers, gather, scatter, exchange = _communication_buffers(model, s)
    if s.autocast:  # of the fp32 (trainable) parameters that linears use; the experts' adapters are
        # cast by the MoE layer itself, one layer at a time (models/common/moe.py: experts_matmul)
        adapters = expert_adapter_ids(model)
        expert_adapters = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters()
                              if p.requires_grad and id(p) in adapters)
        buffers["autocast bf16 weight copies"] = (grads - expert_adapters) // 2
    dequantized = nf4_experts_dequant_bytes(model, s.compute_dtype, s.ep)
    if dequantized:
        buffers["NF4 experts dequantized (1 projection of 1 layer)"] = dequantized
    buffers["logits (until backward)"] = logits
    buffers["loss: fp32 work and the logits' gradient"] = loss_backward
    autocast = buffers.get("autocast bf16 weight copies", 0) + dequantized  # transients beside the activations
    # Backward: the loss's backward first (all activations, the logits and their gradient), which
    # frees the logits; then blocks in reverse, freeing activations as gradients appear. The peak
    # is at the loss, at the first block (one block recomputed, its gradients reduce-scattered),
    # or at the end (all gradients).
    at_loss = params + optimizer + kept + logits + loss_backward + gather + autocast
    at_first_block = params + optimizer + kept + recompute + gather + scatter + autocast + exchange
    end = params + optimizer + grads + gather + scatter + recompute
    phases = {
        "end of forward": params + optimizer + kept + logits + loss_forward + gather + autocast,
        "during backward": max(at_loss, at_first_block, end),
        # The optimizer step: fused AdamW updates state in place; foreach makes ~one fp32 temporary
        # per parameter; Muon gathers one matrix whole at a time (muon_state_bytes).
        "optimizer step": params + grads + optimizer + step_temporaries,
    }
    if s.blocks_with_gradients:  # a pipeline's next forwards run beside the gradients of earlier backwards
        kept_later = blocks_activation_bytes(s, s.blocks_with_gradients)[0]
        phases["backward, micro-batches in flight"] = (params + optimizer + grads + kept_later + logits + loss_backward
                                              + gather + scatter + recompute)
    if s.muon_exclude is not None:
        buffers["Muon: 1 matrix gathered whole, Newton-Schulz"] = step_temporaries
    return MemoryEstimate(params, grads, optimizer, kept, buffers, phases, kind)


def _communication_buffers(model: nn.Module, s: StepShape) -> tuple[dict[str, int], int, int, int]:
    """(buffers, gather, scatter, exchange) in bytes: FSDP's gathered blocks and one block's
    reduce-scattered gradients, and one MoE layer's tokens in flight under EP."""
    pb, rb = dtype_bytes(s.param_dtype), dtype_bytes(s.reduce_dtype)
    block = block_numel(s.args) // s.tp
    if s.ep > 1:  # FSDP gathers only the experts this rank holds, whole (under tp too: ep spans tp's ranks)
        routed = routed_experts_per_block(model)
        block = (block_numel(s.args) - routed) // s.tp + routed // s.ep
    ends = 1 if s.args.tie_embeddings else s.first_stage + s.last_stage  # embedding, output
    root = (s.args.vocab_size * s.args.dim * ends) // s.tp
    buffers: dict[str, int] = {}
    gather = scatter = 0
    if s.fsdp > 1:
        trainable = block if not s.lora_rank else trainable_block_numel(model, s.ep) // s.tp
        gather, scatter = (s.gathered_blocks * block + root) * pb, trainable * (pb + rb)
        buffers[f"FSDP all-gather ({s.gathered_blocks} blocks + root, unsharded)"] = gather
        buffers["FSDP reduce-scatter (1 block's gradients)"] = scatter
    exchange = 0
    if s.ep > 1:  # one MoE layer's tokens in flight: sent, received (at the planned imbalance), sent back
        experts = spec_for_args(s.args).experts(s.args)  # the plan refuses ep > 1 on a dense model
        top_k = experts.top_k if experts else 0
        exchange = int(s.tokens // s.tp * top_k * s.args.dim * dtype_bytes(s.compute_dtype) * (2 + s.ep_imbalance))
        buffers[f"EP all-to-all (1 layer, {s.ep_imbalance:g}x mean received)"] = exchange
    return buffers, gather, scatter, exchange


# torchao's dequantization of one NF4 weight, bytes a value beyond the result: the codes widened to
# int64 (two a byte) and the looked-up and scaled values in the compute dtype (torchao 0.18).
NF4_DEQUANT_INT_BYTES, NF4_DEQUANT_COPIES = 8, 2


def nf4_experts_dequant_bytes(model: nn.Module, compute_dtype: torch.dtype, ep: int = 1) -> int:
    """The largest stack of NF4 experts dequantized for its multiply (layers/nf4_experts.py): this
    rank's experts of one projection (all gathered by FSDP, 1/ep of them under expert parallelism)
    in the compute dtype, and torchao's work on one expert."""
    e = dtype_bytes(compute_dtype)
    planned = nf4_planned_numel(model)
    sizes = [(p.numel() // ep, planned[id(p)]) for p in model.parameters()
             if id(p) in planned and planned[id(p)] != p.numel()]
    return max((stack * e + per * (NF4_DEQUANT_INT_BYTES + NF4_DEQUANT_COPIES * e) for stack, per in sizes), default=0)


# torchao quantizes a weight to NF4 in chunks of this many values, each compared with the 16 levels.
NF4_QUANTIZE_CHUNK = 2**20


def qlora_startup_bytes(model: nn.Module, args: Any, compute_dtype: torch.dtype, ep: int = 1) -> int:
    """QLoRA's start-up peak on each rank (recipe/build.py: stream_qlora_base), from the meta-device
    `model` with its adapters: the whole base (its targets in NF4, the rest in their dtype) and the
    adapters, which every rank holds until FSDP shards them; one unit (a block, or the embedding)
    in the compute dtype as it is materialised; and torchao's work quantizing the largest weight
    (a scaled copy in the compute dtype, a byte a value for the codes, and for one chunk of values
    their distances to the 16 NF4 levels and the absolute values of those, in the compute dtype:
    measured on torch 2.13 / torchao 0.18). Under expert parallelism (`ep`, applied before the
    start-up) a rank holds and quantizes only its 1/ep of the routed experts (and holds 1/ep of their
    adapters). An upper bound: the
    units after the one being quantized are not yet held."""
    planned = nf4_planned_numel(model)
    stacks = [p for p in model.parameters() if id(p) in planned and planned[id(p)] != p.numel()]
    others_experts = sum(planned_nf4_bytes(p.numel(), planned[id(p)]) for p in stacks) * (ep - 1) // ep
    adapters = expert_adapter_ids(model)
    others_experts += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in adapters) * (ep - 1) // ep
    whole = tp_fsdp_state_bytes(model, 1, 1)[0] - others_experts
    e = dtype_bytes(compute_dtype)
    routed = routed_experts_per_block(model) if ep > 1 else 0
    unit = max(block_numel(args) - routed + routed // ep, args.vocab_size * args.dim) * e
    largest = max(nf4_planned_numel(model).values(), default=0)
    quantizing = largest * (e + 1) + min(largest, NF4_QUANTIZE_CHUNK) * 16 * 2 * e
    return whole + unit + quantizing
