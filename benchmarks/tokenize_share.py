"""How much each rank tokenizes per global micro-batch, now that ranks count lengths together.

Four CPU processes (gloo) read the shipped Shakespeare corpus with the shipped tokenizer, as
data-parallel ranks 0-3 (dp 4) and as two replicas of two tensor-parallel ranks (dp 2 x tp 2),
for a fixed number of global micro-batches. Every rank counts the documents it hands to the
tokenizer and the tokens they hold. "Before" is what every rank tokenized before this change:
each document the stream reached, whole (computed from the documents up to the loader's final
position). Two shapes of data:

    plays     the 38 plays as .txt files: one document each, ~48k tokens, longer than a micro-batch
    speeches  the same plays as JSONL, one speech per line (tens of tokens each)

and two micro-batch sizes: train_configs/debug_model.toml's (seq_len 128, local batch 8) and a
long-context one (seq_len 2048, local batch 8).

Run from the repository root (it reads assets/, which the install leaves out):
    OMP_NUM_THREADS=1 python -m benchmarks.tokenize_share
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from assets.make_chat_data import speeches
from weft.components.data import Tokenizer, build_loader, find_text_files
from weft.components.distributed.cpu_ranks import run_distributed

REPO = Path(__file__).resolve().parent.parent

TOKENIZER = REPO / "assets/tokenizer/shakespeare.model"
PLAYS = REPO / "assets/data/shakespeare"
WORLD = 4
LAYOUTS = {"dp4": lambda rank: (rank, 4), "dp2_tp2": lambda rank: (rank // 2, 2)}
SHAPES = [(128, 8, 60), (2048, 8, 12)]  # seq_len, local batch size (at dp 4), micro-batches


class CountingTokenizer(Tokenizer):
    """The SentencePiece tokenizer, counting the documents and tokens it encodes."""

    def __init__(self) -> None:
        super().__init__(TOKENIZER)
        self.documents = self.tokens = 0

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = super().encode(text, bos=bos, eos=eos)
        self.documents, self.tokens = self.documents + 1, self.tokens + len(ids)
        return ids


def measure(files: list[str], layout: str, seq_len: int, batch: int, steps: int) -> tuple[int, int, dict]:
    """On one rank: (documents, tokens) tokenized for `steps` global micro-batches, and the state."""
    import torch.distributed as dist

    dp_rank, dp = LAYOUTS[layout](dist.get_rank())
    tokenizer = CountingTokenizer()
    loader = build_loader("text", [Path(f) for f in files], tokenizer, seq_len=seq_len,
                          local_batch_size=batch * WORLD // dp, dp_rank=dp_rank, dp_world_size=dp)
    for _ in islice(loader, steps):
        pass
    return tokenizer.documents, tokenizer.tokens, loader.state_dict()


def before(files: list[Path], state: dict) -> tuple[int, int]:
    """(documents, tokens) every rank tokenized before: each document from the start of the stream
    up to and including the one the final state points into (the runs stay in epoch 0)."""
    assert state["epoch"] == 0
    tokenizer, documents, tokens = Tokenizer(TOKENIZER), 0, 0
    for index, path in enumerate(files[: state["file_index"] + 1]):
        if path.suffix == ".txt":
            texts = [path.read_text(encoding="utf-8")]
        else:
            texts, offset = [], 0
            for line in path.read_bytes().splitlines(keepends=True):
                if index == state["file_index"] and offset > state["byte_offset"]:
                    break
                if line.strip():
                    texts.append(json.loads(line)["text"])
                offset += len(line)
        documents += len(texts)
        tokens += sum(len(tokenizer.encode(text)) for text in texts)
    return documents, tokens


def speeches_jsonl(folder: Path) -> list[Path]:
    """The plays as JSONL, one speech per line, one file per play."""
    files = []
    for play in find_text_files(str(PLAYS)):
        path = folder / f"{play.stem}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{speaker}:\n{text}"}) + "\n"
                                for speaker, text in (s for s in speeches(play) if s is not None)))
        files.append(path)
    return files


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        data = {"plays": find_text_files(str(PLAYS)), "speeches": speeches_jsonl(Path(tmp))}
        print(f"world {WORLD}; per global micro-batch, each rank's documents / tokens tokenized, "
              "and as a share of before (every rank tokenized all of the stream)")
        for name, files in data.items():
            for seq_len, batch, steps in SHAPES:
                tokens_per_batch = WORLD * batch * (seq_len + 1)
                for layout in LAYOUTS:
                    start = time.perf_counter()
                    ranks = run_distributed(measure, WORLD, [str(f) for f in files], layout, seq_len, batch, steps)
                    seconds = time.perf_counter() - start
                    old_documents, old_tokens = before(files, ranks[0][2])
                    print(f"\n{name}, seq_len {seq_len}, {tokens_per_batch:,} tokens per global micro-batch, "
                          f"{steps} micro-batches, {layout} ({seconds:.1f} s with process start-up)")
                    print(f"  before, every rank: {old_documents / steps:8.2f} documents {old_tokens / steps:10,.0f} tokens")
                    for rank, (documents, tokens, _) in enumerate(ranks):
                        print(f"  rank {rank}:           {documents / steps:8.2f} documents {tokens / steps:10,.0f} tokens"
                              f"   ({documents / old_documents:.2f} / {tokens / old_tokens:.2f} of before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
