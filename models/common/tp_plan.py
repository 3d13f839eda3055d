"""How tensor parallelism splits a decoder's attention and dense SwiGLU feed-forwards: the plan a
dense family's `ModelSpec` hands `apply_tp` as it is (Llama), and an MoE family's starts from
(Llama 4 replaces its MoE feed-forwards' entries). The model files know nothing of it."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

Plan = dict[str, ParallelStyle]


def dense_tp_plan(model: nn.Module, *, loss_parallel: bool = False, float8_linears: Collection[str] = (),
                  float8_styles: dict[str, type[ParallelStyle]] | None = None) -> Plan:
    """`decoder_tp_plan` for `model`: one pattern for every block, or (with float8 layers, which may
    differ between blocks) an entry per block."""
    if not float8_linears:
        return decoder_tp_plan(loss_parallel=loss_parallel)
    return decoder_tp_plan(loss_parallel=loss_parallel, float8_linears=float8_linears, float8_styles=float8_styles,
                           blocks=[f"layers.{name}" for name in model.layers])


# How each block linear of a decoder is split, and which linears read each block input.
_BLOCK_SPLITS = {
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
}
_BLOCK_INPUT_READERS = {"attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}


def decoder_tp_plan(
    *, loss_parallel: bool = False, float8_linears: Collection[str] = (),
    float8_styles: dict[str, type[ParallelStyle]] | None = None, blocks: Iterable[str] = ("layers.*",),
    attention_inputs: int = 2,
) -> Plan:
    """Each block's wq/wk/wv and w1/w3 split by output features (whole heads per rank), wo and w2
    by input features; between them the residual stream and norms are sequence-parallel. The
    embedding and the output are split by vocabulary.

    float8_linears: the model's `Float8Linear` names, which get `float8_styles` (torchao's, gathering
    in float8); an input is gathered in float8 only when every linear reading it is one, and the
    layers kept in high precision get the plain styles. blocks: the block paths to write entries for
    (default: every block). attention_inputs: the attention's positional inputs, hidden state first.
    """
    float8_linears = set(float8_linears)
    plain = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "prepare_input": PrepareModuleInput}
    float8 = float8_styles if float8_linears else plain

    def style(kind: str, readers: Iterable[str]) -> type[ParallelStyle]:
        return float8[kind] if all(reader in float8_linears for reader in readers) else plain[kind]

    plan: Plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Split by vocabulary: logits stay sharded (loss parallel) or are gathered.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    for block in blocks:
        # Attention and the feed-forward need the whole sequence: gather it at their entrance.
        # The rotary rotations (the attention's other inputs) are plain tensors and pass through.
        readers = {part: [f"{block}.{part}.{n}" for n in names] for part, names in _BLOCK_INPUT_READERS.items()}
        others = (None,) * (attention_inputs - 1)
        plan[f"{block}.attention_norm"] = SequenceParallel()
        plan[f"{block}.attention"] = style("prepare_input", readers["attention"])(
            input_layouts=(Shard(1), *others), desired_input_layouts=(Replicate(), *others))
        plan[f"{block}.ffn_norm"] = SequenceParallel()
        plan[f"{block}.feed_forward"] = style("prepare_input", readers["feed_forward"])(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for linear, kind in _BLOCK_SPLITS.items():
            path = f"{block}.{linear}"
            chosen = style(kind, [path])
            plan[path] = chosen(output_layouts=Shard(1)) if kind == "rowwise" else chosen()
    return plan
