"""Parquet, Arrow and compressed JSONL sources: what files.py reads besides `.txt` and `.jsonl`.

`.jsonl.gz` (stdlib gzip) and `.jsonl.zst` (the `zstandard` package) are JSONL files read through a
decompressing stream: their lines are documents exactly as a `.jsonl` file's, positioned by
their offset in the decompressed bytes. A compressed stream cannot seek, so reaching an offset
decompresses (and discards) everything before it.

`.parquet` and `.arrow` (Arrow IPC, file or stream format) files hold one document or record per
row, read with pyarrow in batches of at most ROWS_PER_BATCH rows, only the columns a record
uses, so memory stays bounded by a row group whatever the file's size. Row r is found without
reading earlier rows' data: Parquet's row-group metadata (and an Arrow file's batch lengths) say
which group holds it, and reading starts there. The start-up checks read a file's footer only
(`read_footer`: its schema, a Parquet file's row count; a record format's check also builds the
very first record); the loader reads rows when it reaches them, and names a bad one `file row N`.

pyarrow and zstandard are optional (`pip install "weft[data]"`): `check_readable` names the
missing one, before any run starts.
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

COMPRESSED_JSONL_SUFFIXES = (".jsonl.gz", ".jsonl.zst")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_BATCH = 1024  # rows converted to Python at a time; Parquet reads one row group at a time

_NEEDS = {".jsonl.zst": "zstandard", ".parquet": "pyarrow", ".arrow": "pyarrow"}
_KINDS = {".jsonl.zst": "a zstd-compressed JSONL file", ".parquet": "a Parquet file", ".arrow": "an Arrow file"}


def suffix_of(path: Path, suffixes: tuple[str, ...]) -> str:
    """The suffix among `suffixes` that `path`'s name ends with ('' if none): `.jsonl.gz` is one."""
    return next((s for s in suffixes if path.name.endswith(s)), "")


def is_compressed_jsonl(path: Path) -> bool:
    return bool(suffix_of(path, COMPRESSED_JSONL_SUFFIXES))


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


# -- compressed JSONL ------------------------------------------------------------------------

def decompress_errors() -> tuple[type[BaseException], ...]:
    """What reading a corrupt .gz or .zst stream raises."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


@contextmanager
def open_decompressed(path: Path, offset: int = 0) -> Iterator[IO[bytes]]:
    """The decompressed bytes of a .jsonl.gz/.jsonl.zst file from `offset` on, as a buffered
    binary stream (iterating it yields lines). Seeking decompresses everything before `offset`."""
    with path.open("rb") as raw:
        if path.name.endswith(".gz"):
            stream: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            zstandard = _module("zstandard", path, "data.dataset_path")
            stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        with stream:
            _skip(stream, offset)
            yield stream


def _skip(stream: IO[bytes], size: int) -> None:
    """Read and discard `size` bytes, a MiB at a time: a compressed stream cannot seek."""
    while size > 0:
        chunk = stream.read(min(size, 2**20))
        if not chunk:
            return
        size -= len(chunk)


def decompressed_head(path: Path, size: int) -> bytes:
    """The first `size` decompressed bytes (fewer if the file is shorter), or a DataError."""
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
