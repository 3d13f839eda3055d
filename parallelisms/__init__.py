"""weft's parallel transforms. Each takes a model (and a DeviceMesh) and returns it transformed;
`parallelize` applies them in the one order that composes, and `materialize` allocates and
initialises a meta-device model afterwards."""

from weft.parallelisms.ac import apply_ac
from weft.parallelisms.common import TransformError, transformer_blocks
from weft.parallelisms.compile import apply_compile
from weft.parallelisms.cp import apply_cp, shard_sequence
from weft.parallelisms.ep import apply_ep
from weft.parallelisms.fsdp import apply_ddp, apply_fsdp
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import LayoutError, Meshes, ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize
from weft.parallelisms.pipeline import PipelineStages, build_schedule, default_split, split_model
from weft.parallelisms.tp import apply_tp, hf_tp_plan

__all__ = [
    "LayoutError",
    "Meshes",
    "ParallelDims",
    "ParallelizeOptions",
    "PipelineStages",
    "TransformError",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "build_schedule",
    "default_split",
    "hf_tp_plan",
    "materialize",
    "parallelize",
    "shard_sequence",
    "split_model",
    "transformer_blocks",
]
