"""weft's parallel transforms. Each takes a model (and a DeviceMesh) and returns it transformed;
`parallelize` applies them in the one order that composes, and `materialize` allocates and
initialises a meta-device model afterwards."""

from weft.float8 import Float8Options, apply_float8
from weft.parallelisms.ac import ACOptions, apply_ac
from weft.parallelisms.common import TransformError, transformer_blocks
from weft.parallelisms.compile import CompileOptions, apply_compile
from weft.parallelisms.cp import apply_cp, shard_sequence
from weft.parallelisms.ep import apply_ep
from weft.parallelisms.fsdp import FSDPOptions, apply_ddp, apply_fsdp
from weft.parallelisms.lora import LoRAOptions, apply_lora
from weft.parallelisms.materialize import materialize
from weft.parallelisms.parallel_dims import LayoutError, Meshes, ParallelDims
from weft.parallelisms.parallelize import ParallelizeOptions, parallelize
from weft.parallelisms.pipeline import PipelineOptions, PipelineStages, build_schedule, default_split, split_model
from weft.parallelisms.tp import TPOptions, apply_tp, hf_tp_plan

__all__ = [
    "ACOptions",
    "CompileOptions",
    "FSDPOptions",
    "Float8Options",
    "LoRAOptions",
    "PipelineOptions",
    "TPOptions",
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
    "apply_float8",
    "apply_fsdp",
    "apply_lora",
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
