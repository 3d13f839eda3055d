"""Hugging Face tokenizer folders for the tests, built offline with the `tokenizers` library: the
Llama 3-style one assets/make_chat_data.py builds (byte-level BPE on two plays, Llama 3 special
tokens, BOS post-processor, chat template), and a Qwen3-style one (Qwen's special tokens, no BOS
token, EOS <|im_end|>, pad <|endoftext|>, a ChatML template as Qwen3's renders a conversation)."""

from __future__ import annotations

from pathlib import Path

from assets.make_chat_data import LLAMA3_CHAT_TEMPLATE, build_tokenizer_folder

__all__ = ["LLAMA3_CHAT_TEMPLATE", "QWEN3_CHAT_TEMPLATE", "build_qwen3_tokenizer_folder", "build_tokenizer_folder"]

# Each turn: <|im_start|>role, a newline, the content, <|im_end|>, a newline; the generation prompt
# opens the assistant's turn. (Qwen3's own template adds tool calls and <think> blocks.)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_qwen3_tokenizer_folder(folder: Path, vocab_size: int = 1000) -> Path:
    return build_tokenizer_folder(folder, vocab_size=vocab_size, chat_template=QWEN3_CHAT_TEMPLATE,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos_token=None,
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
