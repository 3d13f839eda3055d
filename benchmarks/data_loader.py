"""How fast does the loader deliver tokens from token shards, from text files, and how fast does a
training step consume them? Prints tokens per second of each and their ratios.

The shipped Shakespeare corpus is prepared into shards (components/data/prepare.py, timed with one
worker and with two) in a temporary folder. Then, alternating so that drift in the machine's speed
hits both alike, a fresh loader reads `--epochs` passes over the corpus in one process
(`build_loader`, no prefetch thread), once from the text files (tokenizing), once from the
shards (memory-mapped) and once from a data.mixture of two shard folders weighted 3:1 (a loader
per source, drawing a window at a time). Last, train.py's plan, model, optimizer and step
(recipe/plan.py, build.py, step.py) for the same batch shape run `--steps` timed steps of train_step: the tokens a
step consumes per second. A loader keeps a step fed when its ratio to the step is well over 1 (the
prefetcher builds batches in a thread beside the step).

Start-up: the time from nothing to the first batch over a temporary folder of `--startup-files`
small Parquet files (a few rows each), for `text` and `prompt_completion`: the plan's checks
(`RunPlan.from_config`: tokenizer, the files' footers, the data fingerprint), the loader's build
and its first batch; and how many files had their data pages read by then, counted at pyarrow's
row-reading entry points (`parquet_data_reads`, which tests/components/data/test_sources.py uses too).
The files were just written, so they are in the page cache: this is the cost of the reads
start-up makes, not of a cold disk.

    OMP_NUM_THREADS=2 python benchmarks/data_loader.py               # debug model on CPU
    python benchmarks/data_loader.py --flavor llama3_1b --seq-len 2048 --batch 1   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from weft.components.config import parse_args
from weft.components.data import Batch, Loader, build_loader, find_text_files, load_tokenizer
from weft.components.data.mixture import Mixture
from weft.components.data.prepare import prepare
from weft.components.data.shards import read_manifest
from weft.models import flavors
from weft.recipe.build import build_trainer
from weft.recipe.plan import RunPlan
from weft.recipe.step import train_step

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "assets/data/shakespeare"
TOKENIZER = REPO / "assets/tokenizer/shakespeare.model"


# ParquetFile's methods that read rows (data pages); opening one, its footer (`metadata`,
# `schema_arrow`) and pyarrow.parquet.read_metadata/read_schema read no data page.
ROW_READERS = ("iter_batches", "read", "read_row_group", "read_row_groups", "scan_contents")


@contextmanager
def parquet_data_reads() -> Iterator[Counter]:
    """Counts, by file path (str), the calls that read a Parquet file's data pages while the
    context is open: ParquetFile's ROW_READERS and pyarrow.parquet.read_table. Footer reads are
    not counted. pyarrow is patched for the duration and restored after."""
    import pyarrow.parquet as pq

    reads: Counter = Counter()
    patched = {name: getattr(pq.ParquetFile, name) for name in ("__init__", *ROW_READERS)}
    read_table = pq.read_table

    def opened(self, source, *args, **kwargs):
        self.weft_counted_source = str(source)
        patched["__init__"](self, source, *args, **kwargs)

    def counting(name):
        def read(self, *args, **kwargs):
            reads[getattr(self, "weft_counted_source", "?")] += 1
            return patched[name](self, *args, **kwargs)
        return read

    def counted_read_table(source, *args, **kwargs):
        reads[str(source)] += 1
        return read_table(source, *args, **kwargs)

    pq.ParquetFile.__init__ = opened
    for name in ROW_READERS:
        setattr(pq.ParquetFile, name, counting(name))
    pq.read_table = counted_read_table
    try:
        yield reads
    finally:
        for name, method in patched.items():
            setattr(pq.ParquetFile, name, method)
        pq.read_table = read_table


def write_parquet_folder(folder: Path, files: int, rows: int) -> list[Path]:
    """`files` Parquet files of `rows` rows each, with columns text, prompt and completion (short
    lines of their file and row), named so that sorting keeps their order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        lines = [f"file {i} row {r}: the king hath happily received the news of thy success" for r in range(rows)]
        paths.append(folder / f"part{i:05d}.parquet")
        pq.write_table(pa.table({"text": lines, "prompt": lines, "completion": [" so all hail"] * rows}), paths[-1])
    return paths


def startup(folder: Path, data_format: str, seq_len: int, batch: int) -> tuple[float, int, int]:
    """(seconds from nothing to the first batch, files whose data pages the plan's checks read,
    files whose data pages were read by the first batch) over the files in `folder`."""
    cfg = parse_args(["--job.config_file", "debug_model", "--data.dataset_path", str(folder), "--data.format",
                      data_format, "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)])
    with parquet_data_reads() as reads:
        start = time.perf_counter()
        plan = RunPlan.from_config(cfg, 1, device_type="cuda" if torch.cuda.is_available() else "cpu",
                                   writes_dump_folder=False)
        at_plan = len(reads)
        loader = build_loader(data_format, plan.data_files, plan.tokenizer, seq_len=seq_len, local_batch_size=batch,
                              cooperate=False)
        next(iter(loader))
        return time.perf_counter() - start, at_plan, len(reads)


def text_loader(files: list[Path], seq_len: int, batch: int) -> Loader:
    """A fresh one-process loader of `files` (text or shards) in data.format text."""
    return build_loader("text", files, load_tokenizer(TOKENIZER), seq_len=seq_len, local_batch_size=batch,
                        cooperate=False)


def mixture_loader(file_lists: list[list[Path]], seq_len: int, batch: int) -> Mixture:
    """A fresh data.mixture of these sources weighted 3:1:...:1 (components/data/mixture.py)."""
    return Mixture([f"source{i}" for i in range(len(file_lists))],
                   [text_loader(files, seq_len, 1) for files in file_lists],
                   [3.0] + [1.0] * (len(file_lists) - 1), local_batch_size=batch)


def loader_tokens_per_second(loader: Loader | Mixture, seq_len: int, batch: int, tokens: int) -> float:
    """Input tokens per second a fresh `loader` delivers, over about `tokens` tokens."""
    batches = iter(loader)
    count = max(1, tokens // (batch * seq_len))
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count * batch * seq_len / (time.perf_counter() - start)


def step_tokens_per_second(flavor: str, seq_len: int, batch: int, steps: int) -> float:
    """Tokens per second train_step consumes, train.py's plan and build for this shape."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = parse_args(["--job.config_file", "debug_model", "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                      "--training.local_batch_size", str(batch)])
    plan = RunPlan.from_config(cfg, 1, device_type=device.type, writes_dump_folder=False)  # measures, writes nothing
    setup = build_trainer(plan, None, device).step
    tokens = torch.randint(0, plan.model_args.vocab_size, (batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    data = Batch(tokens[:, :-1], tokens[:, 1:]).to(device)
    for _ in range(3):  # optimizer state, allocator and caches settle
        train_step(setup, [data])
    start = time.perf_counter()
    for _ in range(steps):
        result = train_step(setup, [data])
    result.loss.item()  # the last step's kernels done
    return steps * batch * seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel", choices=sorted(flavors()))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epochs", type=float, default=0.5, help="passes over the corpus per loader measurement")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-files", type=int, default=2000,
                        help="small Parquet files of the start-up measurement")
    args = parser.parse_args()

    text_files = find_text_files(str(CORPUS))
    text_s, shard_s, mixture_s, prepare_s = [], [], [], {}
    with tempfile.TemporaryDirectory() as folder:
        for workers in (1, 2):
            start = time.perf_counter()
            manifest = prepare(str(CORPUS), str(TOKENIZER), Path(folder) / f"w{workers}", workers=workers)
            prepare_s[workers] = time.perf_counter() - start
        shard_files = read_manifest(Path(folder) / "w1").token_files
        mixed = [shard_files, read_manifest(Path(folder) / "w2").token_files]  # two shard folders, 3:1
        tokens = int(args.epochs * manifest["total_tokens"])
        for _ in range(args.repeats):
            for rates, loader in ((text_s, text_loader(text_files, args.seq_len, args.batch)),
                                  (shard_s, text_loader(shard_files, args.seq_len, args.batch)),
                                  (mixture_s, mixture_loader(mixed, args.seq_len, args.batch))):
                rates.append(loader_tokens_per_second(loader, args.seq_len, args.batch, tokens))
        start = time.perf_counter()
        write_parquet_folder(Path(folder) / "parquet", args.startup_files, rows=3)
        write_s = time.perf_counter() - start
        startups = {fmt: [startup(Path(folder) / "parquet", fmt, args.seq_len, args.batch) for _ in range(args.repeats)]
                    for fmt in ("text", "prompt_completion")}
    step = step_tokens_per_second(args.flavor, args.seq_len, args.batch, args.steps)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    text, shards, mixture = statistics.median(text_s), statistics.median(shard_s), statistics.median(mixture_s)
    print(f"device: {device}; corpus {CORPUS.relative_to(REPO)}: {manifest['total_tokens']:,} tokens, "
          f"{manifest['total_documents']} documents; batch {args.batch} x seq {args.seq_len}; loaders read "
          f"{tokens:,} tokens, {args.repeats} repeats each")
    print(f"prepare: {prepare_s[1]:.2f} s with 1 worker, {prepare_s[2]:.2f} s with 2 (process start-up included)")
    print(f"loader from text   tokens/s: {', '.join(f'{x:,.0f}' for x in text_s)}  (median {text:,.0f})")
    print(f"loader from shards tokens/s: {', '.join(f'{x:,.0f}' for x in shard_s)}  (median {shards:,.0f})")
    print(f"loader from a 3:1 mixture of two shard folders tokens/s: {', '.join(f'{x:,.0f}' for x in mixture_s)}  "
          f"(median {mixture:,.0f})")
    print(f"train_step ({args.flavor}) consumes tokens/s: {step:,.0f} over {args.steps} steps")
    print(f"ratio shards / text loader: {shards / text:.2f}")
    print(f"ratio text loader / step: {text / step:.1f}; shards loader / step: {shards / step:.1f}; "
          f"mixture / step: {mixture / step:.1f}")
    print(f"start-up over {args.startup_files:,} Parquet files of 3 rows (written in {write_s:.2f} s):")
    for fmt, runs in startups.items():
        seconds = statistics.median(s for s, _, _ in runs)
        print(f"  {fmt:<17} to the first batch: {', '.join(f'{s:.2f}' for s, _, _ in runs)} s (median {seconds:.2f}); "
              f"files with data pages read: {runs[-1][1]} by the checks, {runs[-1][2]} by the first batch")


if __name__ == "__main__":
    main()
