"""The data layer: from dataset files and a tokenizer to each rank's micro-batches.

tokenizers, files (finding and reading documents), sources (compressed, Parquet, Arrow), formats
(chat and prompt/completion records), cursor (lengths counted by the ranks together), batch,
windows (text), packing (records), loader (`Loader`, `build_loader`), prefetch, shards and prepare
(token shards), mixture (weighted sources), errors (`DataError`). A new data format is a strategy
(the methods of `loader.Strategy`) and a branch of `build_loader`; a new record shape of the
packed formats is an entry of `formats.SAMPLE_FORMATS` (docs/data.md).
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
