"""Train the shipped SentencePiece BPE tokenizer on the Shakespeare corpus.

    python assets/make_corpus.py      # only if assets/data/shakespeare/ is missing
    python assets/train_tokenizer.py

Writes `assets/tokenizer/shakespeare.model`, byte-identical on every run, and lossless for any
string (identity normalizer, byte fallback, no dummy space prefix): why, in docs/data.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

ASSETS = Path(__file__).resolve().parent
CORPUS_DIR = ASSETS / "data" / "shakespeare"
MODEL_PATH = ASSETS / "tokenizer" / "shakespeare.model"
VOCAB_SIZE = 2048


def corpus_lines(corpus_dir: Path) -> Iterator[str]:
    """Every non-empty line of every play, in sorted file order."""
    for path in sorted(corpus_dir.glob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield line


def main() -> None:
    if not any(CORPUS_DIR.glob("*.txt")):
        raise SystemExit(f"no corpus in {CORPUS_DIR}: run assets/make_corpus.py first")
    MODEL_PATH.parent.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    with MODEL_PATH.open("wb") as model_file:
        spm.SentencePieceTrainer.train(
            sentence_iterator=corpus_lines(CORPUS_DIR),
            model_writer=model_file,
            model_type="bpe",
            vocab_size=VOCAB_SIZE,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            # Determinism: one thread, every sentence, no shuffling.
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    print(f"wrote {MODEL_PATH} ({VOCAB_SIZE} pieces) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
