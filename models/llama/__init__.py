from weft.models.llama.args import LLAMA_FLAVORS, ModelArgs, RopeScaling
from weft.models.llama.model import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock

__all__ = [
    "LLAMA_FLAVORS",
    "ModelArgs",
    "RopeScaling",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
]
