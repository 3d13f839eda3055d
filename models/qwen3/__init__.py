from weft.models.qwen3.args import QWEN3_FLAVORS, ModelArgs
from weft.models.qwen3.model import Transformer, TransformerBlock

__all__ = ["QWEN3_FLAVORS", "ModelArgs", "Transformer", "TransformerBlock"]
