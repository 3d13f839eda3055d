"""Records of the supervised formats, and the samples they become.

`data.format = "chat"` (`{"messages": [...]}`, rendered with the chat template; assistant turns
supervised) and `"prompt_completion"` (`{"prompt", "completion"}` or Alpaca's; completion and EOS
supervised). A record becomes a `Sample`: token ids and, per token, whether it is supervised. Each
format has a check of the record alone, a check of a Parquet/Arrow schema (before training) and
a builder of its sample (on the rank that tokenizes it, naming a bad row `file row N`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from weft.components.data.errors import DataError
from weft.components.data.sources import describe_columns, is_string, struct_list_fields

CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")


@dataclass(frozen=True)
class Sample:
    """Token ids and, per token, whether it is a training target."""

    tokens: list[int]
    supervised: list[bool]


def parse_record(line: bytes, where: str) -> Any:
    """The JSON value of one JSONL line (checked by the format's own check)."""
    try:
        return json.loads(line)
    except ValueError as err:
        raise DataError(f"{where}: expected a line of JSON ({err})") from err


def chat_sample(record: Any, tokenizer: Any, where: str) -> Sample:
    """A `{"messages": [{"role", "content"}, ...]}` record rendered with the tokenizer's chat
    template; the tokens of assistant turns (their content and end-of-turn token) are supervised.

    An assistant turn spans from the end of the conversation before it rendered with the
    generation prompt, to the end of the conversation up to and including it. Tokens are mapped to
    those character spans through the tokenizer's offsets, so the ids are exactly those of the
    whole rendered conversation (what `apply_chat_template` returns).
    """
    messages = check_chat_record(record, where)
    if not hasattr(tokenizer, "render_chat"):
        raise DataError("data.format = 'chat' needs a Hugging Face tokenizer folder with a chat template "
                        "(model.tokenizer_path); a SentencePiece model has none")
    text = tokenizer.render_chat(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        end = tokenizer.render_chat(messages[: i + 1])
        if not (text.startswith(start) and text.startswith(end)):
            raise DataError(f"{where}: the chat template renders a conversation's beginning differently from "
                            "the whole conversation, so assistant turns cannot be located")
        spans.append((len(start), len(end)))
    ids, offsets = tokenizer.encode_with_offsets(text)
    supervised = [any(s <= begin < e for s, e in spans) for begin, _ in offsets]
    return Sample(ids, supervised)


def check_chat_record(record: Any, where: str) -> list[dict[str, Any]]:
    """The record's messages, checked: known roles, string contents, at least one assistant turn."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a JSON object with a non-empty list 'messages'")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be an object with a string 'content'")
        if message.get("role") not in CHAT_ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {message.get('role')!r}; "
                            f"expected one of {', '.join(CHAT_ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn")
    return messages


def prompt_completion_sample(record: Any, tokenizer: Any, where: str) -> Sample:
    """`{"prompt", "completion"}` (or Alpaca's `instruction`, optional `input`, `output`) as
    [BOS] prompt completion [EOS]; the completion and EOS are supervised."""
    prompt, completion = check_prompt_completion_record(record, where)
    prompt_ids = tokenizer.encode(prompt, bos=True, eos=False)
    completion_ids = tokenizer.encode(completion, bos=False, eos=True)
    return Sample(prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids))


def check_prompt_completion_record(record: Any, where: str) -> tuple[str, str]:
    """(prompt, completion) of a prompt/completion or Alpaca record, checked."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        prompt, completion = record["prompt"], record["completion"]
    elif isinstance(record, dict) and isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: 'input' must be a string")
        prompt = record["instruction"] + (f"\n\n{extra}" if extra else "") + "\n\n"
        completion = record["output"]
    else:
        raise DataError(f"{where}: expected a JSON object with string fields 'prompt' and 'completion' "
                        "(or 'instruction' and 'output')")
    return prompt, completion


def check_chat_columns(schema: Any, where: str) -> None:
    """A Parquet/Arrow schema that can hold chat records: a column 'messages', a list of structs
    with string fields 'role' and 'content' (more fields are fine). What only the rows can tell
    (known roles, an assistant turn, no nulls) is checked as the loader reads each row."""
    if "messages" not in schema.names:
        raise DataError(f"data.format = 'chat': {where} has no column 'messages' (its columns: "
                        f"{describe_columns(schema)})")
    kind = schema.field("messages").type
    fields = struct_list_fields(kind) or {}
    if not all(name in fields and is_string(fields[name]) for name in ("role", "content")):
        raise DataError(f"data.format = 'chat': column 'messages' of {where} holds {kind}, expected a list of "
                        "structs with string fields 'role' and 'content'")


def check_prompt_completion_columns(schema: Any, where: str) -> None:
    """A Parquet/Arrow schema that can hold prompt/completion records: string columns 'prompt'
    and 'completion', or 'instruction' and 'output' (with 'input', if there, of strings or only
    nulls). Which of them a row fills is checked as the loader reads it."""
    kinds = {field.name: field.type for field in schema}

    def strings(*names: str) -> bool:
        return all(name in kinds and is_string(kinds[name]) for name in names)

    if strings("prompt", "completion"):
        return
    if strings("instruction", "output") and ("input" not in kinds or strings("input") or str(kinds["input"]) == "null"):
        return
    raise DataError(f"data.format = 'prompt_completion': {where} needs string columns 'prompt' and 'completion' "
                    f"(or 'instruction', 'output' and an optional 'input'); its columns: {describe_columns(schema)}")


class SampleFormat(NamedTuple):
    """A supervised format: the check of a record alone, the check of a Parquet/Arrow file's
    schema, and the builder of its `Sample`."""

    check: Callable[[Any, str], Any]  # (record, where) -> its parts, or a DataError
    sample: Callable[[Any, Any, str], Sample]  # (record, tokenizer, where) -> Sample
    fields: tuple[str, ...]  # the record's keys: the columns read from a Parquet/Arrow row
    check_columns: Callable[[Any, str], None]  # (Arrow schema, file) -> None, or a DataError


SAMPLE_FORMATS = {
    "chat": SampleFormat(check_chat_record, chat_sample, ("messages",), check_chat_columns),
    "prompt_completion": SampleFormat(check_prompt_completion_record, prompt_completion_sample,
                                      ("prompt", "completion", "instruction", "input", "output"),
                                      check_prompt_completion_columns),
}
