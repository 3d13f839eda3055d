"""The prompts file of `weft generate --prompts`: JSONL, one `{"prompt": ...}` a line, the prompt a
string (continued after BOS) or a list of chat messages (rendered with the tokenizer's chat template,
the assistant's turn opened); each line read, checked and encoded, a bad one named by file:line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weft.components.data.errors import DataError
from weft.components.data.files import decode_utf8
from weft.components.data.formats import CHAT_ROLES


@dataclass(frozen=True)
class Prompt:
    """One prompt: its JSON value as the file holds it, its token ids, where it comes from (file:line)."""

    value: str | list[dict[str, Any]]
    token_ids: list[int]
    where: str


def read_prompts(path: str | Path, tokenizer: Any) -> list[Prompt]:
    """Every line of the prompts file at `path`, encoded by `tokenizer`, in order; a DataError names
    the file (unreadable, empty) or the file:line of the first bad line."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DataError(f"--prompts: cannot read {path}: {err.strerror}") from None
    text = decode_utf8(data, str(path), final=True)  # a byte that is not UTF-8 named by its line
    # JSONL lines end at "\n" alone (str.splitlines would also cut at U+2028 inside a JSON string)
    lines = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")] if text else []
    if not lines:
        raise DataError(f"{path}: no prompts; expected one JSON object with a 'prompt' a line")
    return [encode_prompt(_prompt_of(line, f"{path}:{n}"), tokenizer, f"{path}:{n}")
            for n, line in enumerate(lines, start=1)]


def _prompt_of(line: str, where: str) -> str | list[dict[str, Any]]:
    """The `prompt` of one line, checked (`prompt_of`)."""
    try:
        record = json.loads(line)
    except ValueError as err:
        raise DataError(f"{where}: expected a line of JSON ({err})") from None
    return prompt_of(record, where)


def prompt_of(record: Any, where: str) -> str | list[dict[str, Any]]:
    """The `prompt` of one record, checked: a non-empty string, or a non-empty list of chat messages."""
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: the prompt is empty; expected text to continue")
        return prompt
    if not isinstance(prompt, list):
        raise DataError(f"{where}: expected a JSON object with a 'prompt': a string or a list of chat messages")
    if not prompt:
        raise DataError(f"{where}: the prompt is an empty list; expected at least one chat message")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: prompt[{i}] must be an object with a string 'content'")
        if message.get("role") not in CHAT_ROLES:
            raise DataError(f"{where}: prompt[{i}] has unknown role {message.get('role')!r}; "
                            f"expected one of {', '.join(CHAT_ROLES)}")
    return prompt


def encode_prompt(value: str | list[dict[str, Any]], tokenizer: Any, where: str) -> Prompt:
    """A prompt's token ids: text after BOS (no EOS), or chat messages rendered with the chat
    template and the generation prompt (a DataError naming `where` if the tokenizer has none)."""
    if isinstance(value, str):
        ids = tokenizer.encode(value, bos=True, eos=False)
    elif getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a chat prompt needs a tokenizer with a chat template (a Hugging Face folder "
                        "whose tokenizer_config.json has one)")
    else:
        ids = tokenizer.encode_chat(value, add_generation_prompt=True)
    if not ids:
        raise DataError(f"{where}: the prompt encodes to no tokens; expected at least one")
    return Prompt(value, ids, where)


def check_lengths(prompts: list[Prompt], max_completion_length: int, max_seq_len: int) -> None:
    """Refuse (DataError naming its file:line) a prompt whose tokens plus max_completion_length
    exceed the model's context, max_seq_len."""
    for prompt in prompts:
        if len(prompt.token_ids) + max_completion_length > max_seq_len:
            raise DataError(f"{prompt.where}: the prompt's {len(prompt.token_ids)} tokens plus max_completion_length "
                            f"{max_completion_length} make {len(prompt.token_ids) + max_completion_length}, beyond "
                            f"the model's context (max_seq_len {max_seq_len})")
