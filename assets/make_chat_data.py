"""Build an offline chat dataset, and a Llama 3-style tokenizer folder, from the shipped plays.

    python assets/make_chat_data.py            # writes assets/data/shakespeare_chat/ and assets/tokenizer/shakespeare_hf/

Each example is one exchange of a scene (a speech, the next speaker's reply, a system message naming
the part and play); every 20th goes to `validation.jsonl`. The tokenizer is a byte-level BPE with
Llama 3's special tokens, BOS post-processor and a Llama 3-style chat template: what a real Llama 3
folder holds, small (docs/fine-tuning.md). The tests build the same folder.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
PLAYS = ASSETS / "data" / "shakespeare"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Llama 3's template, less its date/tool preamble: a header per turn, content, <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_SPEAKER = re.compile(r"^[A-Z][A-Z .'\-]*[A-Z.]$")  # "HAMLET", "FIRST CLOWN", "LADY MACBETH"
_SCENE = re.compile(r"^(ACT|SCENE) ")


def speeches(play: Path) -> Iterator[tuple[str, str] | None]:
    """(speaker, speech) for each speech of the play, in order; None at each new scene."""
    for block in re.split(r"\n\s*\n", play.read_text(encoding="utf-8")):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if not lines:
            continue
        if _SCENE.match(lines[0]):
            yield None
        elif len(lines) > 1 and _SPEAKER.match(lines[0]):
            yield lines[0].title(), "\n".join(lines[1:])


def exchanges(play: Path, max_chars: int = 700) -> Iterator[dict]:
    """Chat records: a speech and the next, different speaker's reply within the same scene."""
    title = play.read_text(encoding="utf-8").split("\n", 1)[0].strip()
    previous = None
    for speech in speeches(play):
        if speech is not None and previous is not None and speech[0] != previous[0]:
            if len(previous[1]) <= max_chars and len(speech[1]) <= max_chars:
                yield {"messages": [
                    {"role": "system", "content": f"You are {speech[0]} in {title}."},
                    {"role": "user", "content": previous[1]},
                    {"role": "assistant", "content": speech[1]},
                ]}
        previous = speech


def build_tokenizer_folder(folder: Path, *, vocab_size: int = 1000, plays: list[Path] | None = None,
                           chat_template: str | None = LLAMA3_CHAT_TEMPLATE, special_tokens: list[str] = SPECIAL_TOKENS,
                           bos_token: str | None = "<|begin_of_text|>", eos_token: str = "<|end_of_text|>",
                           pad_token: str | None = None) -> Path:
    """Train the BPE tokenizer on `plays` (default: Hamlet and Macbeth) and save it as an HF folder;
    a post-processor prepends `bos_token` unless it is None (as in Qwen's folders)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    plays = plays or [PLAYS / "hamlet.txt", PLAYS / "macbeth.txt"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in plays], trainer)
    if bos_token is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, tokenizer.token_to_id(bos_token))])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": bos_token, "eos_token": eos_token,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
              "clean_up_tokenization_spaces": False}
    if pad_token is not None:
        config["pad_token"] = pad_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_dataset(out: Path, plays: list[Path], validation_every: int = 20) -> tuple[int, int]:
    """train.jsonl and validation.jsonl under `out`; returns their numbers of records."""
    out.mkdir(parents=True, exist_ok=True)
    counts = [0, 0]
    with (out / "train.jsonl").open("w") as train, (out / "validation.jsonl").open("w") as validation:
        index = 0
        for play in plays:
            for record in exchanges(play):
                held_out = index % validation_every == validation_every - 1
                (validation if held_out else train).write(json.dumps(record, ensure_ascii=False) + "\n")
                counts[held_out] += 1
                index += 1
    return counts[0], counts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS / "data" / "shakespeare_chat")
    parser.add_argument("--tokenizer-out", type=Path, default=ASSETS / "tokenizer" / "shakespeare_hf")
    parser.add_argument("--plays", type=int, default=6, help="how many plays (alphabetical) to draw from")
    parser.add_argument("--vocab-size", type=int, default=2000, help="at most the debug model's 2048")
    args = parser.parse_args()
    plays = sorted(PLAYS.glob("*.txt"))[: args.plays]
    n_train, n_validation = write_dataset(args.out, plays)
    build_tokenizer_folder(args.tokenizer_out, vocab_size=args.vocab_size, plays=sorted(PLAYS.glob("*.txt")))
    print(f"{args.out}: {n_train} training and {n_validation} validation conversations; tokenizer in {args.tokenizer_out}")


if __name__ == "__main__":
    main()
