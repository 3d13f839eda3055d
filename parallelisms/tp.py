"""Tensor parallelism for Llama: Megatron-style column/row splits plus sequence parallelism."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallelisms.fsdp import transformer_blocks


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True, float8_all_gather: bool = False
) -> nn.Module:
    """Split a Llama `Transformer` over `tp_mesh`.

    Inside each block, wq/wk/wv and w1/w3 are split by output features (each rank owns whole
    heads: n_heads/tp query heads and n_kv_heads/tp key/value heads, which keeps grouped-query
    attention local) and wo/w2 by input features. Between the splits the activations are
    sequence-parallel: the residual stream and the norms hold 1/tp of the tokens, all-gathered
    before attention and the feed-forward and reduce-scattered after them. The embedding is
    split by vocabulary and the output projection by vocabulary too; with `loss_parallel` its
    logits stay vocabulary-sharded and the loss must run under
    `torch.distributed.tensor.parallel.loss_parallel()`.

    float8_all_gather: the block linears are tensorwise Float8Linear (apply_float8 came
    first) and activations are cast to float8 before they are all-gathered, with torchao's
    float8 styles; needs a backend that can all-gather float8 (NCCL, not gloo).

    Apply first among the transforms (after float8), on the meta-device model, before AC,
    compile and FSDP. Head counts must be divisible by the tp degree.
    """
    tp = tp_mesh.size()
    for name in ("n_heads", "kv_heads"):
        heads = getattr(model.args, name)
        if heads % tp:
            raise ValueError(f"parallelism.tp = {tp} does not divide the model's {name} = {heads}")
    if model.args.tie_embeddings:
        # The embedding and the output projection would each replace the shared weight with a
        # DTensor of their own, silently untying them.
        raise ValueError("tensor parallelism does not support tied embeddings (llama3_1b, llama3_3b)")

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
    )
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8_all_gather:
        from float8 import float8_tp_styles

        styles = float8_tp_styles()
        colwise, rowwise, prepare_input = styles["colwise"], styles["rowwise"], styles["prepare_input"]
    block_plan = {
        "attention_norm": SequenceParallel(),
        # Attention and the feed-forward need the whole sequence: gather it at their entrance.
        # The rotary rotations (the attention's other input) are a plain tensor and pass through.
        "attention": prepare_input(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, block_plan)
    return model

