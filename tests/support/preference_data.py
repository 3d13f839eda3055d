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
