from weft.models.llama4.args import LLAMA4_FLAVORS, ModelArgs
from weft.models.llama4.model import Attention, Transformer, TransformerBlock

__all__ = ["LLAMA4_FLAVORS", "ModelArgs", "Attention", "Transformer", "TransformerBlock"]
