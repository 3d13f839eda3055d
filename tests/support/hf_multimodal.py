"""Multimodal Hugging Face folders for the transformers backend's tests, written by transformers
around a text folder's model: Gemma 3 (a tiny SigLIP vision tower, the head tied as the text
model's), Mistral 3 (a tiny Pixtral vision tower, its own head) and Qwen3.5 (its own vision tower,
saved under transformers' newer names, `model.language_model.`), their text model holding the text
folder's weights, the towers drawn at random."""

from __future__ import annotations

from pathlib import Path

import torch

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=8)
CLASSES = {"gemma3_text": "Gemma3ForConditionalGeneration", "mistral": "Mistral3ForConditionalGeneration",
           "qwen3_5_text": "Qwen3_5ForConditionalGeneration"}


def multimodal_config(text_config):
    """The multimodal config holding `text_config` (a gemma3_text or mistral config)."""
    import transformers

    tied = text_config.tie_word_embeddings
    if text_config.model_type == "gemma3_text":
        return transformers.Gemma3Config(text_config=text_config.to_dict(), mm_tokens_per_image=4,
                                         vision_config=transformers.SiglipVisionConfig(**VISION).to_dict(),
                                         image_token_index=text_config.vocab_size - 1, tie_word_embeddings=tied)
    if text_config.model_type == "qwen3_5_text":
        vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                  patch_size=8, out_hidden_size=text_config.hidden_size,
                                                  num_position_embeddings=16)
        return transformers.Qwen3_5Config(text_config=text_config.to_dict(), vision_config=vision.to_dict(),
                                          tie_word_embeddings=tied)
    return transformers.Mistral3Config(text_config=text_config.to_dict(), image_token_index=text_config.vocab_size - 1,
                                       vision_config=transformers.PixtralVisionConfig(**VISION, head_dim=8).to_dict(),
                                       spatial_merge_size=2, tie_word_embeddings=tied)


def write_multimodal_folder(text_folder: Path, out: Path) -> Path:
    """The ConditionalGeneration folder (`CLASSES`) whose text model is the causal LM of `text_folder`."""
    import transformers

    torch.manual_seed(1)
    text = transformers.AutoModelForCausalLM.from_pretrained(text_folder)
    model = getattr(transformers, CLASSES[text.config.model_type])(multimodal_config(text.config))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out)
    return out
