"""The dataset's files: finding them, checking their start before a run, and reading them as
documents.

A document is a whole `.txt` file (or `.txt.gz`, `.txt.zst`: the same document, decompressed),
one non-blank line of a `.jsonl` file (or of a `.jsonl.gz` or `.jsonl.zst` one, read through a
decompressing stream), or one row of a `.parquet` or `.arrow` file (components/data/sources.py).
`documents(files, start)` walks them in file order from any `DocStart`, epoch after epoch,
reading JSONL lines but parsing none: each is parsed by the one rank that tokenizes it
(components/data/cursor.py). A row is read as {column: value}.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from weft.components.data import sources
from weft.components.data.errors import DataError
from weft.components.data.sources import COLUMNAR_SUFFIXES, COMPRESSED_SUFFIXES

TEXT_SUFFIXES = (".txt", ".jsonl", *COMPRESSED_SUFFIXES, *COLUMNAR_SUFFIXES)
PLAIN_TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")  # a whole file is one document
SUFFIX_NAMES = ", ".join(TEXT_SUFFIXES)

# How much of each file check_text_files reads before training: all of a small file, the start
# of a large one, so the check stays a few seconds even for a corpus of many gigabytes.
SCAN_BYTES = 64 * 2**10


def find_text_files(dataset_path: str, key: str = "data.dataset_path") -> list[Path]:
    """The data file (TEXT_SUFFIXES) at `dataset_path`, or all of them under that folder, sorted;
    a DataError if one needs a reader that is not installed (pyarrow, zstandard)."""
    path = Path(dataset_path)
    if path.is_file():
        files = [path] if sources.suffix_of(path, TEXT_SUFFIXES) else []
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if sources.suffix_of(p, TEXT_SUFFIXES) and p.is_file())
    else:
        raise DataError(f"{key}: no file or folder at '{dataset_path}'")
    if not files:
        raise DataError(f"{key}: no .txt or .jsonl file (nor .jsonl.gz, .jsonl.zst, .parquet, .arrow) at or under "
                        f"'{dataset_path}', nor a .txt.gz or .txt.zst one")
    sources.check_readable(files, key)
    return files


def is_plain_text(path: Path) -> bool:
    """A .txt file, compressed or not: the whole file is one document."""
    return bool(sources.suffix_of(path, PLAIN_TEXT_SUFFIXES))


def _line_of(data: bytes, offset: int) -> int:
    """1-based line number of byte `offset` in `data`."""
    return data[:offset].count(b"\n") + 1


def decode_utf8(data: bytes, where: str, final: bool, *, one_line: bool = False) -> str:
    """`data` as UTF-8 text, or a DataError naming `where`:line (`where` alone if `one_line`:
    it names the line already). A NUL byte means binary data. With `final` False the data is a
    prefix, and a character cut at its end is not an error."""
    def at(offset: int) -> str:
        return where if one_line else f"{where}:{_line_of(data, offset)}"

    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{at(nul)}: a NUL byte; this looks like a binary file, not text")
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as err:
        raise DataError(f"{at(err.start)}: expected UTF-8 text (byte {data[err.start]:#04x}: {err.reason})") from None


def parse_jsonl_record(line: bytes, text_field: str, where: str) -> str:
    """The text of one JSONL line: a JSON object whose `text_field` is a string."""
    text = decode_utf8(line, where, final=True, one_line=True)
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{where}: expected a line of JSON ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise DataError(f"{where}: expected a JSON object with a text field '{text_field}'")
    return record[text_field]


def check_text_files(files: list[Path], text_field: str = "text") -> None:
    """Check the first SCAN_BYTES of every file (decompressed, for .gz/.zst) before anything is
    written: a binary file, another encoding, a broken JSONL record, a corrupt or cut-short stream
    stop the run at once naming file:line (blank JSONL lines are skipped, as the loader skips them).
    Of a Parquet/Arrow file only the footer is read: `text_field` must be a string column; a bad row
    (a null text) is named `file row N` when the loader reaches it.

    Raises DataError also when every file was read whole and no document holds any text. Problems
    past the scanned prefix are reported, with file:line, when the loader reaches them.
    """
    any_text, read_whole = False, True
    for path in files:
        if sources.is_columnar(path):
            rows = sources.check_text_column(path, text_field)
            read_whole = read_whole and rows == 0  # its rows are not read: only none tells they are empty
            continue
        try:
            data = _read(path, SCAN_BYTES + 1)
        except OSError as err:
            raise DataError(f"data.dataset_path: cannot read {path}: {err.strerror}") from None
        whole = len(data) <= SCAN_BYTES
        data, read_whole = data[:SCAN_BYTES], read_whole and whole
        if is_plain_text(path):
            text = decode_utf8(data, str(path), final=whole)
            any_text = any_text or bool(text.strip())
            continue
        lines = data.split(b"\n")
        if not whole:
            lines = lines[:-1]  # the last line may be cut by the prefix
        for number, line in enumerate(lines, start=1):
            if line.strip():
                text = parse_jsonl_record(line, text_field, f"{path}:{number}")
                any_text = any_text or bool(text.strip())
    if read_whole and not any_text:
        raise DataError(f"data.dataset_path: every document in {len(files)} file(s) is empty ({named(files)}); "
                        "nothing to train on")


def _read(path: Path, size: int = -1) -> bytes:
    """The first `size` bytes of the file's text (all if -1; decompressed, for a .gz/.zst file)."""
    if sources.is_compressed(path):
        return sources.read_decompressed(path, size)
    with path.open("rb") as f:
        return f.read(size)


def check_suffixes(files: list[Path], suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """`files` as Paths, each a file a loader reads (TEXT_SUFFIXES)."""
    if not files:
        raise DataError(f"data.dataset_path: no {SUFFIX_NAMES} files to read")
    for path in files:
        if not sources.suffix_of(Path(path), suffixes):
            raise DataError(f"data.dataset_path: '{path}' is not a {SUFFIX_NAMES} file")
    return [Path(path) for path in files]


@dataclass(frozen=True)
class DocStart:
    """Where a document starts: a whole .txt (.txt.gz, .txt.zst) file, one line of a JSONL file,
    or one row of a Parquet/Arrow file (its row index + 1 in `line_number`: the record's 1-based
    number)."""

    epoch: int
    file_index: int
    byte_offset: int = 0  # of the line in a .jsonl file (in the decompressed bytes of a .jsonl.gz/.zst); else 0
    line_number: int = 1  # 1-based, for error messages; row + 1 in a Parquet/Arrow file


# A loader's state: where the document it stands in starts, and how many of its tokens were read.
STATE_KEYS = ("epoch", "file_index", "byte_offset", "line_number", "token_offset")


def position_state(doc: DocStart, token_offset: int) -> dict[str, int]:
    """The loader state of a position in the stream: token `token_offset` of the document at `doc`."""
    return {"epoch": doc.epoch, "file_index": doc.file_index, "byte_offset": doc.byte_offset,
            "line_number": doc.line_number, "token_offset": token_offset}


class RawDoc(NamedTuple):
    """A document found but not yet read: its start, its size in bytes (what every rank knows of
    it before anyone tokenizes it; of a .txt.gz/.txt.zst file, its compressed size: an estimate
    that only shares the counting out), and its line if it is one of a JSONL file (None for a
    .txt file, compressed or not, read by whichever rank tokenizes it), or its row
    ({column: value}) if it is one of a Parquet/Arrow file (its size: the characters of its
    strings)."""

    start: DocStart
    size: int
    line: bytes | None
    row: dict[str, Any] | None = None


def documents(files: list[Path], start: DocStart, columns: tuple[str, ...] | None = None) -> Iterator[RawDoc]:
    """Every document from `start` on, looping over the files forever; of a Parquet/Arrow file's
    rows, only `columns` are read (None: all)."""
    while True:
        from_beginning = start.file_index == 0 and start.byte_offset == 0 and start.line_number == 1
        found = False
        for file_index in range(start.file_index, len(files)):
            at = start if file_index == start.file_index else DocStart(start.epoch, file_index)
            for doc in _file_documents(files[file_index], at, columns):
                found = True
                yield doc
        if from_beginning and not found:
            raise DataError(f"data.dataset_path: no documents in {len(files)} file(s) ({named(files)})")
        start = DocStart(start.epoch + 1, file_index=0)


def _file_documents(path: Path, start: DocStart, columns: tuple[str, ...] | None = None) -> Iterator[RawDoc]:
    """The documents of one file, from `start` on."""
    if is_plain_text(path):
        yield RawDoc(start, path.stat().st_size, None)
        return
    if sources.is_compressed(path):
        yield from _compressed_documents(path, start)
        return
    if sources.is_columnar(path):
        yield from _row_documents(path, start, columns)
        return
    offset, line_number = start.byte_offset, start.line_number
    with path.open("rb") as f:
        f.seek(offset)
        for line in f:
            doc = DocStart(start.epoch, start.file_index, offset, line_number)
            offset, line_number = offset + len(line), line_number + 1
            if line.strip():
                yield RawDoc(doc, len(line), line)


def _compressed_documents(path: Path, start: DocStart) -> Iterator[RawDoc]:
    """The lines of a .jsonl.gz/.jsonl.zst file from `start` on, as `.jsonl` lines are read;
    reaching `start.byte_offset` decompresses everything before it. The file is first
    decompressed whole (sources.check_whole), so that a damaged one is refused before any of its
    lines is read, not after the lines its damage spoiled."""
    sources.check_whole(path)
    offset, line_number = start.byte_offset, start.line_number
    try:
        with sources.open_decompressed(path, offset) as f:
            for line in f:
                doc = DocStart(start.epoch, start.file_index, offset, line_number)
                offset, line_number = offset + len(line), line_number + 1
                if line.strip():
                    yield RawDoc(doc, len(line), line)
    except sources.decompress_errors() as err:
        raise DataError(f"{path}:{line_number}: cannot decompress ({err})") from None


def _row_documents(path: Path, start: DocStart, columns: tuple[str, ...] | None) -> Iterator[RawDoc]:
    """The rows of a Parquet/Arrow file from row `start.line_number - 1` on, read in batches."""
    for row, record in sources.rows(path, start.line_number - 1, columns):
        yield RawDoc(DocStart(start.epoch, start.file_index, 0, row + 1), sources.record_size(record), None, record)


def named(files: list[Path], most: int = 3) -> str:
    """The files for a message: all of them, or the first `most` and how many more."""
    shown = ", ".join(str(path) for path in files[:most])
    return shown if len(files) <= most else f"{shown} and {len(files) - most} more"


def where(files: list[Path], doc: DocStart) -> str:
    """The document's place for messages: file:line in a JSONL file, `file row N` (0-based) in a
    Parquet/Arrow file, the file for a .txt one."""
    path = files[doc.file_index]
    if sources.is_columnar(path):
        return f"{path} row {doc.line_number - 1}"
    return str(path) if is_plain_text(path) else f"{path}:{doc.line_number}"


def record_of(files: list[Path], raw: RawDoc, parse: Callable[[bytes, str], Any]) -> Any:
    """A record: its row, or its JSONL line parsed by `parse(line, where)`."""
    return raw.row if raw.row is not None else parse(raw.line, where(files, raw.start))


def read_text(files: list[Path], raw: RawDoc, text_field: str) -> str:
    """The document's text: a whole .txt file (decompressed, if .gz/.zst), the `text_field` of a
    JSONL line, or the `text_field` column of a row."""
    if raw.row is not None:
        text = raw.row.get(text_field)
        if not isinstance(text, str):
            raise DataError(f"{where(files, raw.start)}: expected a string in column '{text_field}', "
                            f"got {'null' if text is None else type(text).__name__}")
        return text
    if raw.line is None:
        path = files[raw.start.file_index]
        return decode_utf8(_read(path), str(path), final=True)
    return parse_jsonl_record(raw.line, text_field, where(files, raw.start))


def file_documents(files: list[Path], start: DocStart, columns: tuple[str, ...] | None = None) -> Iterator[RawDoc]:
    """The documents of one file from `start` to its end, once (documents() loops forever)."""
    return _file_documents(files[start.file_index], start, columns)
