"""weft's generation engine: batched, KV-cached sampling from a model as it is laid out for training
(`generate`, engine.py), with the options of `SamplingParams` (sampling.py). It reaches a model only
through its spec (`Backend.decoding`: how the model runs with a KV cache)."""

from weft.generation.engine import Completion, generate
from weft.generation.errors import GenerationError
from weft.generation.sampling import SamplingParams

__all__ = ["Completion", "GenerationError", "SamplingParams", "generate"]
