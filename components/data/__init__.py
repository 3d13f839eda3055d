"""The data layer: from dataset files and a tokenizer to each rank's micro-batches.

    tokenizers.py  `Tokenizer` (SentencePiece), `HFTokenizer` (a Hugging Face folder, chat
                   templates) and `load_tokenizer`, which picks one by its path
    files.py       finding the data files, checking their start before a run, reading
                   them as documents (`documents`, `DocStart`, `RawDoc`)
    sources.py     what files.py reads besides .txt/.jsonl: .gz/.zst streams of either,
                   Parquet and Arrow rows in batches (pyarrow, zstandard: weft[data])
    formats.py     chat and prompt/completion records and the `Sample`s they become
    cursor.py      the cooperative cursor: document lengths counted by the ranks together
    batch.py       the one `Batch`, `BatchShape` (this rank's block of a global micro-batch),
                   `document_layout`
    windows.py     `TextWindows`: the token stream cut into windows (data.format = "text")
    packing.py     `PackedSamples`: whole samples packed into windows (chat, prompt_completion)
    loader.py      `Loader`, the one loader class, which a strategy above fills; `build_loader`,
                   the one factory; `batches`
    prefetch.py    `Prefetcher` / `prefetch`: batches built ahead in a background thread
    shards.py      token shards: the manifest, its checks, `ShardWindows` (text windows over
                   memory-mapped token ids, no tokenizing at run time)
    prepare.py     `python -m weft.components.data.prepare`: a corpus tokenized into shards
    errors.py      `DataError`, every data mistake a user can fix

A new data format is a strategy (an object with the methods of `loader.Strategy`) and a branch of
`build_loader`; a new record shape of the packed formats is an entry of `formats.SAMPLE_FORMATS`.
"""

from weft.components.data.batch import Batch, BatchShape, document_layout
from weft.components.data.errors import DataError
from weft.components.data.files import SCAN_BYTES, TEXT_SUFFIXES, check_text_files, find_text_files
from weft.components.data.formats import SAMPLE_FORMATS, Sample, chat_sample, prompt_completion_sample
from weft.components.data.loader import Loader, batches, build_loader
from weft.components.data.packing import PackedSamples
from weft.components.data.prefetch import Prefetcher, prefetch
from weft.components.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer
from weft.components.data.windows import TextWindows

__all__ = [
    "SAMPLE_FORMATS", "SCAN_BYTES", "TEXT_SUFFIXES", "Batch", "BatchShape", "DataError", "HFTokenizer", "Loader",
    "PackedSamples", "Prefetcher", "Sample", "TextWindows", "Tokenizer", "batches", "build_loader",
    "chat_sample", "check_text_files", "document_layout", "find_text_files", "load_tokenizer", "prefetch",
    "prompt_completion_sample",
]
