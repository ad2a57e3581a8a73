"""Every fenced block of the README and docs/, read with Sybil (a documentation-testing library
that parses Markdown into examples, fenced blocks in list items and block quotes included):

- ``python`` blocks run, in order, in one namespace per page (``>>>`` examples as doctests that
  must print what the page shows). Pages whose code needs a trained run get one, at a smaller
  size, in a scratch directory (slow tier).
- ``bash``, ``sh``, ``shell`` and ``console`` blocks (a ``console`` block's ``$ `` lines) have
  every command that runs a ``launch`` module or script parsed by that entry point's real
  argument parser, its ``key=value`` overrides applied to the config, and its ``--attention`` /
  ``--rope`` items to the model's (tests/doc_commands.py); nothing runs.
- ``text`` blocks, and ``console`` blocks with output, are output: each carries a marker on the
  line above, ``<!-- output checked by tests/FILE.py::TEST -->`` (TEST exists and its code names
  this page) or ``<!-- example output: THE RUN IT CAME FROM -->``; ``<!-- listing -->`` marks a
  hand-written listing that no program prints.
- A block without a language is an error: the language says which check applies.
"""

from __future__ import annotations

import ast
import doctest
import re
from pathlib import Path

import pytest
from sybil import Document, Region, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from tests import doc_commands
from tests.helpers import ROOT, TINY_RUN
from tests.tiers import slow

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
OTHER_LANGUAGES = {"toml", "yaml", "json", "bibtex", "ini"}  # shown, not run
CHECKED = re.compile(r"^<!-- output checked by (tests/[\w/]+\.py)::(\w+) -->$")
EXAMPLE = re.compile(r"^<!-- example output: (\S.*\S) -->$")
LISTING = "<!-- listing -->"
# pages another engineer owns that still use the bare marker; the lead applies the run names
BARE_EXAMPLE = "<!-- example output -->"
BARE_EXAMPLE_PENDING = {"docs/guides/faults.md"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _marker_above(document: Document, start: int) -> str:
    """The line above a block (its marker), unindented."""
    before = document.text[:start].rstrip("\n").rpartition("\n")[2]
    return before.strip()


class FencedBlockParser:
    """Every fenced block that is not ``python`` (Sybil's own parser runs those): its language,
    source and marker, evaluated by the check its language calls for."""

    def __init__(self):
        self.lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"[ \t]*(?P<language>[\w+-]*)[^\n]*$\n", re.MULTILINE))

    def __call__(self, document: Document):
        for region in self.lexer(document):
            language = region.lexemes["language"]
            if language == "python":
                continue
            region.parsed = (language, str(region.lexemes["source"]), _marker_above(document, region.start))
            region.evaluator = _evaluate_block
            yield Region(region.start, region.end, region.parsed, region.evaluator)


def _evaluate_block(example) -> str | None:
    language, source, marker = example.parsed
    page = Path(example.path)
    if language == "":
        return "a fenced block without a language: label it (bash, console, text, python, ...) so that its check applies"
    problems = []
    if language in SHELL:
        problems += shell_problems(source, prompt=language == "console")
        output = language == "console" and any(line.strip() and not line.lstrip().startswith("$ ") for line in source.splitlines())
    elif language == "text":
        output = True
    elif language in OTHER_LANGUAGES:
        output = False
    else:
        return f"a {language!r} block: no check knows this language (tests/test_doc_pages.py)"
    if output:
        problems += marker_problems(page, marker)
    return "; ".join(problems) or None


def shell_problems(source: str, prompt: bool = False) -> list[str]:
    problems = []
    for words in doc_commands.segments(source, prompt=prompt):
        try:
            found = doc_commands.launch_command(words)
        except doc_commands.UnknownForm as e:
            problems.append(f"a launch command in a form tests/doc_commands.py does not know: {e}")
            continue
        if found and (error := doc_commands.check(*found)):
            problems.append(f"{found[0]} {' '.join(found[1])}: {error}")
    return problems


def marker_problems(page: Path, marker: str) -> list[str]:
    if EXAMPLE.match(marker) or marker == LISTING:
        return []
    if marker == BARE_EXAMPLE:
        return [] if _rel(page) in BARE_EXAMPLE_PENDING else [f"{BARE_EXAMPLE} must say which run it came from: <!-- example output: RUN -->"]
    checked = CHECKED.match(marker)
    if not checked:
        return [f"an output block without a marker (line above: {marker[:60]!r})"]
    file, test = checked.groups()
    source = test_source(ROOT / file, test)
    if source is None:
        return [f"no test {file}::{test}"]
    if page.name not in source:
        return [f"{file}::{test} does not read {_rel(page)} (its code does not name the page)"]
    return []


def test_source(file: Path, test: str) -> str | None:
    """The source of function ``test`` in ``file`` (None: no such function)."""
    if not file.is_file():
        return None
    text = file.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == test:
            return ast.get_source_segment(text, node)
    return None


test_source.__test__ = False  # a helper, not a test

SYBIL_BLOCKS = Sybil(parsers=[FencedBlockParser()])
SYBIL_PYTHON = Sybil(parsers=[PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS)])


def _blocks():
    for page in PAGES:
        for example in SYBIL_BLOCKS.parse(page):
            language, source, _ = example.parsed
            first = source.strip().splitlines()[0][:60] if source.strip() else ""
            yield pytest.param(example, id=f"{_rel(page)}:{example.line} {language or '(none)'}: {first}")


@pytest.mark.parametrize("example", list(_blocks()))
def test_block(example):
    """Each block passes its language's check."""
    example.evaluate()


# --- python blocks ------------------------------------------------------------------------------

ATTENTION_REFERENCE = ROOT / "docs" / "reference" / "attention.md"
FIRST_SLOW_HEADING = "### `interpolated_attention(q, k, v, *, window, base, alpha, return_lse=False, implementation=None)`"
# pages whose code needs a trained run in ./runs/tiny (given one at TINY_RUN's size: slow tier)
NEEDS_TINY_RUN = {"docs/getting-started.md", "docs/guides/sampling.md"}
# pages whose code trains its own run or takes more than a few seconds (slow tier)
SLOW_PYTHON = {"docs/guides/attention-in-your-model.md", "docs/reference/attention.md"} | NEEDS_TINY_RUN


def python_pages():
    return [p for p in PAGES if re.search(r"^[ \t]*```python\s*$", p.read_text(), flags=re.M)]


def run_python(page: Path, stop_at: str | None = None) -> int:
    """Evaluate the page's python examples in order, up to the line ``stop_at``; the number run."""
    document = SYBIL_PYTHON.parse(page)
    end = document.text.index(f"\n{stop_at}\n") if stop_at else len(document.text)
    count = 0
    for example in document:
        if example.start < end:
            example.evaluate()
            count += 1
    return count


def test_the_python_pages_are_known():
    """A page with Python code runs in the fast tier unless listed as slow; this keeps the lists
    true (a page that lost its code must leave them)."""
    pages = {_rel(p) for p in python_pages()}
    assert SLOW_PYTHON <= pages


@pytest.mark.parametrize("page", [p for p in python_pages() if _rel(p) not in SLOW_PYTHON], ids=_rel)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_python(page) >= 1


def test_attention_reference_runs_up_to_the_first_slow_path():
    """The fast tier's share of docs/reference/attention.md: the conventions, the attended set and
    offset_attention (about 3 s with a cold compilation cache; the whole page is the slow tier's)."""
    assert run_python(ATTENTION_REFERENCE, stop_at=FIRST_SLOW_HEADING) >= 10


@slow
def test_attention_reference_runs():
    assert run_python(ATTENTION_REFERENCE) >= 19


@slow
def test_attention_guide_runs(tmp_path, monkeypatch):
    """The guide's code trains a run in runs/recent; the attention kind it registers is removed
    afterwards, so other tests see the built-in ones."""
    from fibjax import kinds

    monkeypatch.chdir(tmp_path)
    try:
        assert run_python(ROOT / "docs" / "guides" / "attention-in-your-model.md") >= 4
    finally:
        kinds.unregister("recent")
    assert (tmp_path / "runs" / "recent" / "eval" / "6-len_32_64.json").is_file()


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory):
    """A directory holding runs/tiny: the main job's 200 steps and evaluation, at TINY_RUN's size."""
    from launch import train

    root = tmp_path_factory.mktemp("tiny")
    assert train.main(["--workdir", str(root / "runs" / "tiny"), "--no-progress", *TINY_RUN]) == 0
    assert (root / "runs" / "tiny" / "eval" / "200.json").is_file()
    return root


@slow
@pytest.mark.parametrize("page", sorted(NEEDS_TINY_RUN))
def test_python_blocks_run_on_a_trained_run(page, tiny_run_dir, monkeypatch):
    monkeypatch.chdir(tiny_run_dir)
    assert run_python(ROOT / page) >= 1
