"""A Llama 3-style Hugging Face tokenizer folder for the tests: the one assets/make_chat_data.py
builds (byte-level BPE on two plays, Llama 3 special tokens, BOS post-processor, chat template)."""

from __future__ import annotations

from assets.make_chat_data import LLAMA3_CHAT_TEMPLATE, build_tokenizer_folder

__all__ = ["LLAMA3_CHAT_TEMPLATE", "build_tokenizer_folder"]
