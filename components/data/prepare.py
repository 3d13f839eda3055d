"""Tokenize a corpus once into token shards (components/data/shards.py) that runs read memory-mapped:

    python -m weft.components.data.prepare --source <file or folder of .txt/.jsonl> \\
        --tokenizer <path> --out <folder> [--workers N] [--text-field text]

Documents, their order and their BOS/EOS wrapping are exactly the text loader's
(`data.format = "text"`: `TextWindows.build`). Each source file becomes one shard, tokenized by
one of `--workers` processes; the shards and the manifest are the same bytes whatever the number
of workers. Everything is written into a temporary folder beside `--out`, renamed to `--out` at
the end, so a failed prepare leaves nothing; an existing `--out` is refused. A bad input is one
line `weft: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from weft.components.config.dump_folder import check_creatable_folder
from weft.components.data.errors import DataError
from weft.components.data.files import check_text_files, file_documents, find_text_files
from weft.components.data.shards import (FORMAT_VERSION, MANIFEST, OFFSETS_DTYPE, OFFSETS_SUFFIX, TOKENS_SUFFIX,
                                         shard_dtype, shard_name, tokenizer_identity)
from weft.components.data.tokenizers import load_tokenizer
from weft.components.data.windows import TextWindows
from weft.components.errors import UserError, report_user_error
from weft.components.fingerprint import data_fingerprint

_windows: TextWindows | None = None  # each worker's tokenizer, loaded once


def _start_worker(tokenizer_path: str, text_field: str) -> None:
    global _windows
    _windows = TextWindows(load_tokenizer(tokenizer_path), text_field=text_field)


def _write_shard(task: tuple[list[Path], int, Path, str]) -> tuple[int, int]:
    """Tokenize every document of file `file_index` as the text loader does, and write its shard
    (ids, boundaries) into `folder`; (tokens, documents)."""
    files, file_index, folder, dtype = task
    ids: list[int] = []
    offsets = [0]
    for raw in file_documents(files, file_index):
        ids += _windows.build(files, raw)
        offsets.append(len(ids))
    name = folder / shard_name(file_index)
    np.asarray(ids, dtype=dtype).tofile(name.with_suffix(TOKENS_SUFFIX))
    np.asarray(offsets, dtype=OFFSETS_DTYPE).tofile(name.with_suffix(OFFSETS_SUFFIX))
    return len(ids), len(offsets) - 1


def prepare(source: str, tokenizer_path: str, out: Path, *, workers: int = 1, text_field: str = "text") -> dict:
    """Write the shards of `source` into `out` (which must not exist); the manifest."""
    if workers < 1:
        raise UserError(f"--workers = {workers}: expected at least 1")
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
        tasks = [(files, i, temporary, dtype.str) for i in range(len(files))]
        if workers == 1:
            _start_worker(tokenizer_path, text_field)
            counts = [_write_shard(task) for task in tasks]
        else:
            # forked where the system can (the workers run only the tokenizer and numpy), so a
            # worker starts without importing weft again
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with context.Pool(min(workers, len(files)), _start_worker, (tokenizer_path, text_field)) as pool:
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
        "shards": [{"name": shard_name(i), "tokens": tokens, "documents": docs} for i, (tokens, docs) in enumerate(counts)],
        "sources": [{"name": name, **facts} for name, facts in fingerprint.items()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weft.components.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="a .txt/.jsonl file, or a folder of them")
    parser.add_argument("--tokenizer", required=True, help="a SentencePiece model file or a Hugging Face folder")
    parser.add_argument("--out", required=True, help="the shard folder to create (must not exist)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (one source file each)")
    parser.add_argument("--text-field", default="text", help="the text field of .jsonl records")
    args = parser.parse_args(argv)
    try:
        manifest = prepare(args.source, args.tokenizer, Path(args.out), workers=args.workers, text_field=args.text_field)
    except UserError as err:
        return report_user_error(err)
    print(f"weft: {manifest['total_tokens']:,} tokens of {manifest['total_documents']:,} documents in "
          f"{len(manifest['shards'])} shard(s) ({manifest['dtype']}) at {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
