"""Parquet, Arrow and compressed sources: what files.py reads besides `.txt` and `.jsonl`.

`.txt.gz`, `.jsonl.gz`, `.txt.zst` and `.jsonl.zst` are read through a decompressing stream; a cut
or corrupt stream raises where the read reaches the damage (a zstd file must end where a frame
ends, `_ZstdFrames`), and a compressed JSONL file is read whole once (`check_whole`) before its
first line is handed out. `.parquet` and `.arrow` files hold one document or record per row, read
in batches of at most ROWS_PER_BATCH rows; start-up reads footers only (`read_footer`).
`check_readable` names a missing optional package (weft[data]). Why: docs/data.md.
"""

from __future__ import annotations

import gzip
import importlib
import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NamedTuple

from weft.components.data.errors import DataError

COMPRESSED_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".txt.gz", ".txt.zst")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 1024  # rows converted to Python at a time; Parquet reads one row group at a time
READ_BYTES = 2**20  # of a compressed file read (or decompressed output skipped) at a time

_NEEDS = {".jsonl.zst": "zstandard", ".txt.zst": "zstandard", ".parquet": "pyarrow", ".arrow": "pyarrow"}
_KINDS = {".jsonl.zst": "a zstd-compressed JSONL file", ".txt.zst": "a zstd-compressed text file",
          ".parquet": "a Parquet file", ".arrow": "an Arrow file"}


def suffix_of(path: Path, suffixes: tuple[str, ...]) -> str:
    """The suffix among `suffixes` that `path`'s name ends with ('' if none): `.jsonl.gz` is one."""
    return next((s for s in suffixes if path.name.endswith(s)), "")


def is_compressed(path: Path) -> bool:
    return bool(suffix_of(path, COMPRESSED_SUFFIXES))


def is_columnar(path: Path) -> bool:
    return bool(suffix_of(path, COLUMNAR_SUFFIXES))


def _module(name: str, path: Path, key: str) -> Any:
    """Import `name`, or a DataError saying which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        kind = _KINDS[suffix_of(path, tuple(_KINDS))]
        raise DataError(f"{key}: {path} is {kind}, which needs {name.split('.')[0]}: "
                        'pip install "weft[data]"') from None


def check_readable(files: list[Path], key: str = "data.dataset_path") -> None:
    """A DataError naming the first file whose reader (pyarrow, zstandard) is not installed."""
    for path in files:
        needed = _NEEDS.get(suffix_of(path, tuple(_NEEDS)))
        if needed is not None:
            _module(needed, path, key)


# -- compressed text and JSONL ---------------------------------------------------------------

def decompress_errors() -> tuple[type[BaseException], ...]:
    """What reading a cut or corrupt .gz or .zst stream raises."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file's frames, one after another. A file that ends inside
    a frame (an interrupted copy) raises EOFError at its end: zstandard's own stream reader ends
    there quietly, as if the file were whole."""

    def __init__(self, raw: IO[bytes], zstandard: Any) -> None:
        self._raw, self._new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self._read_size = zstandard.DECOMPRESSION_RECOMMENDED_INPUT_SIZE  # compressed bytes read at a time
        self._frame, self._fed = self._new_frame(), False  # the frame being read; whether any of it was read
        self._out, self._at = memoryview(b""), 0  # decompressed, not yet returned: self._out[self._at:]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._out):
            if not self._decompress():
                return 0
        size = min(len(buffer), len(self._out) - self._at)
        buffer[:size] = self._out[self._at : self._at + size]
        self._at += size
        return size

    def _decompress(self) -> bool:
        """Decompress the next compressed bytes into self._out; False at the end of the file."""
        data = b""
        if self._frame.eof:  # what followed the frame's end starts the next frame
            data, self._frame, self._fed = self._frame.unused_data, self._new_frame(), False
        data = data or self._raw.read(self._read_size)
        if not data:
            if self._fed:
                raise EOFError("the file ends inside a zstd frame: it was cut short")
            return False
        self._out, self._at, self._fed = memoryview(self._frame.decompress(data)), 0, True
        return True


@contextmanager
def open_decompressed(path: Path, offset: int = 0) -> Iterator[IO[bytes]]:
    """The decompressed bytes of a .gz/.zst file from `offset` on, as a buffered binary stream
    (iterating it yields lines). Seeking decompresses everything before `offset`. A cut or
    corrupt file raises one of decompress_errors() when the read reaches the damage."""
    with path.open("rb") as raw:
        if path.name.endswith(".gz"):
            stream: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            stream = io.BufferedReader(_ZstdFrames(raw, _module("zstandard", path, "data.dataset_path")), READ_BYTES)
        with stream:
            _skip(stream, offset)
            yield stream


def _skip(stream: IO[bytes], size: int) -> None:
    """Read and discard `size` bytes, READ_BYTES at a time: a compressed stream cannot seek."""
    while size > 0:
        chunk = stream.read(min(size, READ_BYTES))
        if not chunk:
            return
        size -= len(chunk)


def check_whole(path: Path) -> None:
    """Decompress the whole file, keeping nothing: a DataError naming it, and the line being read
    when decompression failed, if it is cut short or corrupt. gzip's CRC and a zstd frame's
    checksum are checked only at the stream's end, after the bytes they cover were read, so a
    file streamed line by line would hand out the lines a changed byte spoiled before the check
    failed."""
    read = 0  # lines read whole
    try:
        with open_decompressed(path) as f:
            for read, _ in enumerate(f, start=1):
                pass
    except decompress_errors() as err:
        raise DataError(f"{path}:{read + 1}: cannot decompress ({err})") from None


def read_decompressed(path: Path, size: int = -1) -> bytes:
    """The first `size` decompressed bytes (all of them if -1; fewer if the file is shorter), or
    a DataError naming the file if it cannot be decompressed that far."""
    try:
        with open_decompressed(path) as f:
            return f.read(size)
    except decompress_errors() as err:
        raise DataError(f"{path}: cannot decompress ({err})") from None


# -- Parquet and Arrow -----------------------------------------------------------------------

def _open_arrow(path: Path) -> Any:
    """An Arrow IPC file reader, or (stream format, as a Hugging Face datasets cache holds) a
    stream reader; both memory-mapped, so skipping a batch touches only its metadata."""
    pa = _module("pyarrow", path, "data.dataset_path")
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source)


class Footer(NamedTuple):
    """What a Parquet/Arrow file says of itself without its data: its schema, and its row count
    (from a Parquet footer; None for an Arrow file, whose batch lengths lie throughout the file)."""

    schema: Any
    rows: int | None


def read_footer(path: Path) -> Footer:
    """The file's schema and row count, from its metadata alone (a Parquet footer; an Arrow file's
    schema message), or a DataError if it is no Parquet/Arrow file or its metadata is corrupt."""
    pa = _module("pyarrow", path, "data.dataset_path")
    try:
        if path.name.endswith(".parquet"):
            metadata = _module("pyarrow.parquet", path, "data.dataset_path").read_metadata(path)
            return Footer(metadata.schema.to_arrow_schema(), metadata.num_rows)
        return Footer(_open_arrow(path).schema, None)
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> DataError:
    """The one-line error for a file pyarrow cannot open (its message may span lines)."""
    kind = _KINDS[suffix_of(path, COLUMNAR_SUFFIXES)]
    return DataError(f"{path}: cannot read it as {kind} ({' '.join(str(err).split())})")


def read_schema(path: Path) -> Any:
    """The file's schema, from its metadata alone, or a DataError (read_footer)."""
    return read_footer(path).schema


def is_string(kind: Any) -> bool:
    """An Arrow type whose values are Python strings (string, large_string, string_view)."""
    pa = importlib.import_module("pyarrow")
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind))


def struct_list_fields(kind: Any) -> dict[str, Any] | None:
    """{name: type} of the struct fields of a list-of-structs type; None if `kind` is none."""
    pa = importlib.import_module("pyarrow")
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind) \
        or getattr(pa.types, "is_list_view", lambda _: False)(kind) \
        or getattr(pa.types, "is_large_list_view", lambda _: False)(kind)
    if not lists or not pa.types.is_struct(kind.value_type):
        return None
    struct = kind.value_type
    return {struct.field(i).name: struct.field(i).type for i in range(struct.num_fields)}


def describe_columns(schema: Any) -> str:
    """`name: type, ...` of a schema's columns, for messages ('none' if it has none)."""
    return ", ".join(f"{field.name}: {field.type}" for field in schema) or "none"


def check_text_column(path: Path, column: str) -> int | None:
    """The file has a string column `column` (read from its footer only), else a DataError;
    returns its row count (None: an Arrow file, whose count its footer does not hold)."""
    schema, rows = read_footer(path)
    if column not in schema.names:
        raise DataError(f"data.text_field = {column!r}: {path} has no column '{column}' "
                        f"(its columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field(column).type
    if not is_string(kind):
        raise DataError(f"data.text_field = {column!r}: column '{column}' of {path} holds {kind}, expected strings")
    return rows


def _batches(path: Path, first_row: int, columns: tuple[str, ...] | None) -> Iterator[tuple[int, Any]]:
    """(row index of its first row, record batch) from the batch holding `first_row` on, with only
    `columns` (those of them the file has; None: all). Earlier row groups are not read."""
    schema = read_schema(path)
    names = [name for name in schema.names if columns is None or name in columns]
    if path.name.endswith(".parquet"):
        parquet = _module("pyarrow.parquet", path, "data.dataset_path")
        with parquet.ParquetFile(path) as f:
            row, group = 0, 0
            while group < f.num_row_groups and row + f.metadata.row_group(group).num_rows <= first_row:
                row += f.metadata.row_group(group).num_rows
                group += 1
            for batch in f.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=range(group, f.num_row_groups),
                                        columns=names, use_threads=False):
                yield row, batch
                row += batch.num_rows
        return
    reader, row = _open_arrow(path), 0
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if hasattr(reader, "get_batch") else reader
    for batch in batches:
        if row + batch.num_rows > first_row:
            yield row, batch.select(names)
        row += batch.num_rows


def rows(path: Path, first_row: int, columns: tuple[str, ...] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, {column: value}) of every row from `first_row` on, ROWS_PER_BATCH at a time."""
    for row, batch in _batches(path, first_row, columns):
        for start in range(max(first_row - row, 0), batch.num_rows, ROWS_PER_BATCH):
            for i, record in enumerate(batch.slice(start, ROWS_PER_BATCH).to_pylist()):
                yield row + start + i, record


def record_size(value: Any) -> int:
    """Characters in every string of a record (a size estimate; what the cursor shares work by)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(record_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(record_size(v) for v in value)
    return 0
