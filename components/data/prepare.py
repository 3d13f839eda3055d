"""Tokenize a corpus once into token shards (components/data/shards.py) that runs read memory-mapped:

    python -m weft.components.data.prepare --source <file or folder of .txt/.jsonl> \\
        --tokenizer <path> --out <folder> [--workers N] [--text-field text] [--shard-bytes N]

Documents, their order and BOS/EOS are exactly the text loader's; the output is the same bytes for
any `--workers`, written into a temporary folder renamed to `--out` at the end (docs/data.md).
"""

from __future__ import annotations

import array
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from weft.components.config.dump_folder import check_creatable_folder
from weft.components.config.shipped import shipped_path
from weft.components.data.files import DocStart, check_text_files, file_documents, find_text_files
from weft.components.data.fingerprint import data_fingerprint
from weft.components.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    OFFSETS_DTYPE,
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    shard_dtype,
    shard_name,
    tokenizer_identity,
)
from weft.components.data.tokenizers import load_tokenizer
from weft.components.data.windows import TextWindows
from weft.errors import OneLineParser, UserError, report_user_error

SHARD_BYTES = 256 * 2**20  # of a .jsonl source per shard, so one large file is tokenized by many workers
_windows: TextWindows | None = None  # each worker's tokenizer, loaded once


def _start_worker(tokenizer_path: str, text_field: str) -> None:
    global _windows
    _windows = TextWindows(load_tokenizer(tokenizer_path), text_field=text_field)


def _pieces(files: list[Path], piece_bytes: int) -> list[tuple[DocStart, int | None]]:
    """What each shard holds: (where it starts, the byte its source piece ends at; None: the file's
    end). A plain .jsonl file is cut at the first line start at or after every `piece_bytes`
    bytes, its line numbers counted, so that the pieces depend on the files alone; any other file
    (a .txt, a compressed or columnar one) is one piece."""
    pieces: list[tuple[DocStart, int | None]] = []
    for index, path in enumerate(files):
        size = path.stat().st_size
        if not path.name.endswith(".jsonl") or size <= piece_bytes:
            pieces.append((DocStart(0, index), None))
            continue
        with path.open("rb") as f:
            start, line = 0, 1
            while start < size:
                f.seek(start + piece_bytes - 1)
                end = min(f.tell() + len(f.readline()), size)  # after the line holding byte start + piece_bytes - 1
                pieces.append((DocStart(0, index, start, line), end))
                line += _newlines(f, start, end)
                start = end
    return pieces


def _newlines(f, start: int, end: int, block: int = 2**24) -> int:
    """Newlines in bytes [start, end) of open file `f`, read a block at a time."""
    f.seek(start)
    count = 0
    while start < end:
        data = f.read(min(block, end - start))
        count, start = count + data.count(b"\n"), start + len(data)
    return count


def _write_shard(task: tuple[list[Path], int, DocStart, int | None, Path, str]) -> tuple[int, int]:
    """Tokenize the documents of one piece of a source file (from `start` to byte `end`) as the
    text loader does, and write them as shard `index` (ids, boundaries) into `folder`;
    (tokens, documents)."""
    files, index, start, end, folder, dtype = task
    ids = array.array("H" if np.dtype(dtype).itemsize == 2 else "I")  # compact: a piece may hold 10^8 ids
    offsets = [0]
    for raw in file_documents(files, start, _windows.columns):
        if end is not None and raw.start.byte_offset >= end:  # a .jsonl line of the next piece
            break
        ids.extend(_windows.build(files, raw))
        offsets.append(len(ids))
    name = folder / shard_name(index)
    np.frombuffer(ids, dtype=ids.typecode).astype(dtype).tofile(name.with_suffix(TOKENS_SUFFIX))
    np.asarray(offsets, dtype=OFFSETS_DTYPE).tofile(name.with_suffix(OFFSETS_SUFFIX))
    return len(ids), len(offsets) - 1


def prepare(source: str, tokenizer_path: str, out: Path, *, workers: int = 1, text_field: str = "text",
            shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the shards of `source` into `out` (which must not exist); the manifest."""
    if workers < 1:
        raise UserError(f"--workers = {workers}: expected at least 1")
    if shard_bytes < 1:
        raise UserError(f"--shard-bytes = {shard_bytes}: expected at least 1")
    if out.exists():
        raise UserError(f"--out = {out}: already exists; expected a new folder (shards are never overwritten)")
    check_creatable_folder(out, f"--out = {out}")
    if not Path(tokenizer_path).exists():
        raise UserError(f"--tokenizer = {tokenizer_path}: no tokenizer file or folder")
    files = find_text_files(source, key="--source")
    check_text_files(files, text_field)
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = shard_dtype(tokenizer.vocab_size)
    temporary = out.parent / f".{out.name}.partial-{os.getpid()}"
    temporary.mkdir(parents=True)
    try:
        pieces = _pieces(files, shard_bytes)
        tasks = [(files, i, start, end, temporary, dtype.str) for i, (start, end) in enumerate(pieces)]
        if workers == 1:
            _start_worker(tokenizer_path, text_field)
            counts = [_write_shard(task) for task in tasks]
        else:
            # forked where the system can (the workers run only the tokenizer and numpy), so a
            # worker starts without importing weft again
            forks = "fork" in multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if forks else "spawn")
            with context.Pool(min(workers, len(tasks)), _start_worker, (tokenizer_path, text_field)) as pool:
                counts = pool.map(_write_shard, tasks, chunksize=1)
        manifest = _manifest(source, files, tokenizer_path, tokenizer, dtype, text_field, counts)
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        temporary.rename(out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return manifest


def _manifest(source, files, tokenizer_path, tokenizer, dtype, text_field, counts) -> dict:
    fingerprint = data_fingerprint(files, source)
    return {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "tokenizer": tokenizer_identity(tokenizer_path, tokenizer),
        "text_field": text_field,
        "total_tokens": sum(tokens for tokens, _ in counts),
        "total_documents": sum(docs for _, docs in counts),
        "shards": [{"name": shard_name(i), "tokens": tokens, "documents": docs}
                   for i, (tokens, docs) in enumerate(counts)],
        "sources": [{"name": name, **facts} for name, facts in fingerprint.items()],
    }


def main(argv: list[str] | None = None, prog: str = "python -m weft.components.data.prepare") -> int:
    """`weft prepare`; a shipped asset (`assets/...`) is found in the package as training finds it."""
    parser = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="a .txt/.jsonl file, or a folder of them")
    parser.add_argument("--tokenizer", required=True, help="a SentencePiece model file or a Hugging Face folder")
    parser.add_argument("--out", required=True, help="the shard folder to create (must not exist)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (one shard at a time each)")
    parser.add_argument("--shard-bytes", type=int, default=SHARD_BYTES,
                        help="cut .jsonl files into shards of about this many source bytes, at line starts")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl records")
    args = parser.parse_args(argv)
    try:
        manifest = prepare(shipped_path(args.source), shipped_path(args.tokenizer), Path(args.out),
                           workers=args.workers, text_field=args.text_field, shard_bytes=args.shard_bytes)
    except UserError as err:
        return report_user_error(err)
    print(f"weft: {manifest['total_tokens']:,} tokens of {manifest['total_documents']:,} documents in "
          f"{len(manifest['shards'])} shard(s) ({manifest['dtype']}) at {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
