from weft.models.gpt_oss.args import GPT_OSS_FLAVORS, ModelArgs
from weft.models.gpt_oss.model import Transformer, TransformerBlock

__all__ = ["GPT_OSS_FLAVORS", "ModelArgs", "Transformer", "TransformerBlock"]
