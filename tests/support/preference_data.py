"""Preference records for the preference tests, drawn from Hamlet: the chosen answer is the line that
follows the prompt, the rejected one the same words in reverse order (a preference a model that read
Shakespeare can learn), in TRL's standard (strings) and conversational (messages) formats."""

from __future__ import annotations

from assets.make_chat_data import speeches

from tests.support import REPO


def hamlet_lines() -> list[str]:
    return [" ".join(s[1].split()) for s in speeches(REPO / "assets/data/shakespeare/hamlet.txt") if s is not None]


def make_pairs(n: int, offset: int = 0, answer_chars: int = 60, chat: bool = False) -> list[dict]:
    """`n` records from line `offset` on: {prompt, chosen, rejected} as strings, or (chat) as
    messages, every third one a whole conversation without 'prompt'."""
    lines = hamlet_lines()
    records = []
    for i in range(offset, offset + n):
        prompt = lines[i % len(lines)][:40]
        chosen = lines[(i + 1) % len(lines)][:answer_chars]
        rejected = " ".join(reversed(chosen.split()))
        if rejected == chosen:
            rejected = chosen + " " + chosen
        if not chat:
            records.append({"prompt": prompt + "\n", "chosen": chosen, "rejected": rejected})
            continue
        question = [{"role": "user", "content": prompt}]
        chosen_turn, rejected_turn = ([{"role": "assistant", "content": text}] for text in (chosen, rejected))
        if i % 3 == 0:
            records.append({"chosen": question + chosen_turn, "rejected": question + rejected_turn})
        else:
            records.append({"prompt": question, "chosen": chosen_turn, "rejected": rejected_turn})
    return records


def trl_ids(hf, prompt, answer) -> tuple[list[int], int]:
    """TRL 1.16's tokenization of one answer, with a transformers tokenizer `hf` alone: the prompt
    (with the generation prompt) and prompt + answer tokenized whole; the answer starts where the two
    lists diverge (strings: the EOS token's text appended to an answer that lacks it). Returns the ids
    and that start."""
    if isinstance(answer, str):
        eos = "" if answer.endswith(hf.eos_token) else hf.eos_token
        prompt_ids, ids = hf(prompt)["input_ids"], hf(prompt + answer + eos)["input_ids"]
    else:
        prompt_ids = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = hf.apply_chat_template(prompt + answer, tokenize=True)
        prompt_ids, ids = (list(getattr(x, "input_ids", x)) for x in (prompt_ids, ids))
    start = next(i for i, (a, b) in enumerate(zip(ids, prompt_ids + [None] * len(ids))) if a != b)
    return ids, start


def split_record(record: dict) -> tuple:
    """(prompt, (chosen answer, rejected answer)) of a record; a whole conversation's prompt is what
    precedes its last assistant turn."""
    if "prompt" in record:
        return record["prompt"], (record["chosen"], record["rejected"])
    return record["chosen"][:-1], (record["chosen"][-1:], record["rejected"][-1:])
