"""The documentation holds together: every relative link of README.md, docs/*.md and
benchmarks/results/README.md points at a file that exists (and, with a #anchor, at a heading of
it, slugged as GitHub slugs headings), the README and every docs page stay short, the README links
every docs page, and library module docstrings say what a module is for while docs/ keep the prose."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support import REPO

README_LIMIT = 20_000  # bytes: a README read in one sitting; the rest lives in docs/
PAGE_LIMIT = 20_000  # bytes: a docs page on one topic; a longer one splits by topic
DOCSTRING_LINES = 10  # a module docstring says what the module is for; measured figures and reasoning go to docs/
FUNCTION_LINES = 60  # a library function's longest, its signature and docstring included
DEF_DOCSTRING_LINES = 12  # a function's or class's docstring says what it does and assumes
LONG_DOCSTRINGS: dict[str, str] = {}  # module -> why its docstring is longer (at most 5; the reason is in it too)

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", flags=re.M)


def documentation() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks/results/README.md"]


def prose(text: str) -> str:
    """The text a reader sees as markdown: fenced blocks removed (a `# comment` there is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, the second of two equal ones suffixed -1 (and so on), as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The targets of the inline links of a markdown file, outside code blocks and code spans."""
    text = prose(path.read_text())
    # a code span inside a link's text stays a link: only spans outside [...] hide brackets
    return LINK.findall(CODE_SPAN.sub(lambda m: m.group(0).replace("[", "").replace("]", "").replace("(", ""), text))


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each relative link of `path` that does not resolve, as 'file: target (why)', paths from `root`."""
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        name = f"{path.relative_to(root)}: {target}"
        if not dest.exists():
            problems.append(f"{name} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{name} (no heading with that anchor in {dest.relative_to(root)})")
    return problems


def test_slugs_follow_githubs_rule():
    # anchors the README used before the split, as GitHub rendered them
    assert slug("Slow ranks, time left, Weights & Biases") == "slow-ranks-time-left-weights--biases"
    assert slug("Mixtures of sources") == "mixtures-of-sources"
    assert slug("Fine-tune with LoRA / QLoRA") == "fine-tune-with-lora--qlora"
    assert slug("Use weft's transforms on your own model") == "use-wefts-transforms-on-your-own-model"
    assert slug("First run on GPUs (issue 22)") == "first-run-on-gpus-issue-22"


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Real part\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#real-part) [`code` ok](a.md) [gone](c.md) [bad](a.md#not-a-heading) "
                    "[web](https://example.com/x) `[not](a link)` [self](#b)\n\n# B\n"
                    "```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["b.md: c.md (no such file)",
                                  "b.md: a.md#not-a-heading (no heading with that anchor in a.md)"]


@pytest.mark.parametrize("page", documentation(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert page.is_file()
    assert broken_links(page) == []


def test_the_readme_is_short():
    size = (REPO / "README.md").stat().st_size
    assert size < README_LIMIT, f"README.md is {size:,} bytes; move detail into a docs/ page"


def test_the_readme_links_every_docs_page():
    readme = REPO / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme) if not t.startswith("#")}
    pages = sorted((REPO / "docs").glob("*.md"))
    assert pages, "docs/ holds the topic pages"
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_every_docs_page_is_short():
    sizes = {p.name: p.stat().st_size for p in sorted((REPO / "docs").glob("*.md"))}
    assert {name: size for name, size in sizes.items() if size >= PAGE_LIMIT} == {}, "split the page by topic"


def module_docstring_lines(path: Path) -> int:
    """The lines a module's docstring spans in its file, its quotes included (0 without one)."""
    body = ast.parse(path.read_text()).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return 0
    return first.end_lineno - first.lineno + 1


def library_modules() -> list[Path]:
    """Every Python file of the package: the repository less tests/, benchmarks/ and hidden folders."""
    top = lambda p: p.relative_to(REPO).parts[0]  # noqa: E731
    return [p for p in sorted(REPO.rglob("*.py")) if top(p) not in ("tests", "benchmarks") and not top(p).startswith(".")]


def test_docstring_lines_count_the_quotes(tmp_path):
    (tmp_path / "a.py").write_text('"""One line."""\nx = 1\n')
    (tmp_path / "b.py").write_text('"""First.\n\nThird.\n"""\n')
    (tmp_path / "c.py").write_text("x = 1\n")
    assert [module_docstring_lines(tmp_path / n) for n in ("a.py", "b.py", "c.py")] == [1, 4, 0]


def test_module_docstrings_are_short():
    assert len(LONG_DOCSTRINGS) <= 5
    lines = {str(p.relative_to(REPO)): module_docstring_lines(p) for p in library_modules()}
    assert len(lines) > 100 and "parallelisms/cp.py" in lines and not any(n.startswith("tests/") for n in lines)
    too_long = {name: n for name, n in lines.items() if n > DOCSTRING_LINES and name not in LONG_DOCSTRINGS}
    assert too_long == {}, "move measured figures and design reasoning to the docs page of the topic"
    assert [name for name in LONG_DOCSTRINGS if lines.get(name, 0) <= DOCSTRING_LINES] == []  # no stale entry


def long_definitions(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """({function: lines} over FUNCTION_LINES, {function or class: docstring lines} over DEF_DOCSTRING_LINES)
    of one file, nested definitions included; a docstring's lines count its quotes."""
    long_bodies, long_docs = {}, {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if not isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
            long_bodies[node.name] = node.end_lineno - node.lineno + 1
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            if first.end_lineno - first.lineno + 1 > DEF_DOCSTRING_LINES:
                long_docs[node.name] = first.end_lineno - first.lineno + 1
    return long_bodies, long_docs


def test_long_definitions_are_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    doc = "\n".join(["    class Inner:", '        """One.'] + ["        more"] * DEF_DOCSTRING_LINES + ['        """'])
    (tmp_path / "m.py").write_text(f"def outer():\n{doc}\n{body}\n\ndef short():\n    return 1\n")
    bodies, docs = long_definitions(tmp_path / "m.py")
    assert bodies == {"outer": FUNCTION_LINES + DEF_DOCSTRING_LINES + 4} and docs == {"Inner": DEF_DOCSTRING_LINES + 2}


def test_functions_are_short_and_their_docstrings_too():
    """No library function over FUNCTION_LINES lines but train.py's `train`, the recipe read top to
    bottom; no function or class docstring over DEF_DOCSTRING_LINES (docs say why)."""
    bodies, docs = {}, {}
    for path in library_modules():
        long_bodies, long_docs = long_definitions(path)
        name = str(path.relative_to(REPO))
        bodies.update({f"{name}::{f}": n for f, n in long_bodies.items() if (name, f) != ("train.py", "train")})
        docs.update({f"{name}::{f}": n for f, n in long_docs.items()})
    assert bodies == {}, "split the function: a plan of what it does and the steps"
    assert docs == {}, "move measured figures and design reasoning to the docs page of the topic"
