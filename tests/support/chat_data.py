"""Chat records for the fine-tuning tests, drawn from Hamlet, and a JSON-lines file of records."""

from __future__ import annotations

import json
import random
from pathlib import Path

from assets.make_chat_data import speeches

from tests.support import REPO


def make_chats(n: int, seed: int = 0, long_chars: int = 120) -> list[dict]:
    """Chat records from Hamlet whose answers are either one word or a long speech, so supervised
    lengths differ by more than an order of magnitude (a wrong normalisation would show)."""
    rng = random.Random(seed)
    lines = [s[1] for s in speeches(REPO / "assets/data/shakespeare/hamlet.txt") if s is not None]
    records = []
    for i in range(n):
        question = lines[i % len(lines)].split("\n")[0][:60]
        answer = lines[(i + 1) % len(lines)]
        answer = answer.split()[0] if rng.random() < 0.5 else answer[:long_chars]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer as a player would."})
        records.append({"messages": messages})
    return records


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
