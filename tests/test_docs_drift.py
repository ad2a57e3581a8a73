"""What the README, the docs, the help texts and the error messages claim stays true:

- every ``launch`` command shown in the prose (inline code) and in a message or help text (any
  string in fibjax/, launch/, configs/) parses with the entry point's real parser, with its
  config overrides and ``--attention`` / ``--rope`` items applied (tests/doc_commands.py; the
  fenced blocks are tests/test_doc_pages.py's);
- every link resolves (Markdown inline and reference-style links, with or without a title, images,
  HTML ``href`` / ``src``; a reference with no definition is an error), anchors included; every
  ``docs/PAGE.md#anchor`` a message names resolves; every "page, section" reference names a
  heading;
- the attention reference's headings carry the real signatures; the config-name pattern expands
  to the config files; each topic's timings (any unit: s, min, h) appear on its owner page only.
tests/plant_doc_faults.py plants a mistake of each kind and checks that some test fails.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests import doc_commands
from tests.helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
# where messages, help texts and comments live
SOURCES = sorted(itertools.chain(*(ROOT.glob(f"{d}/**/*.py") for d in ("fibjax", "launch", "configs")), ROOT.glob("launch/*.sh")))
LOG = ROOT / "docs" / "dev" / "log.md"  # the log keeps its commands as they were run


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- commands in the prose, the help texts and the messages ------------------------------------

INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
MARKDOWN = MarkdownIt("commonmark").enable("table")


def _prose_code(page: Path) -> list[str]:
    """The inline code spans of a page's prose (not its fenced blocks)."""
    spans = []
    for token in MARKDOWN.parse(page.read_text()):
        for child in token.children or []:
            if child.type == "code_inline":
                spans.append(child.content)
    return spans


def _commands_in(text: str):
    """(module, words) of each launch command in a piece of prose or a string, and the
    problems of the segments that name a launch module in an unknown form."""
    for words in doc_commands.segments(text):
        try:
            found = doc_commands.launch_command(words)
        except doc_commands.UnknownForm as e:
            yield "?", [str(e)]
            continue
        if found:
            yield found


def _strings(path: Path):
    """(line, text) of every string constant in a Python file; an f-string's holes read ``{}``."""
    tree = ast.parse(path.read_text())
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            yield node.lineno, node.value


# a command quoted in a message ends where the prose resumes: at a newline, a backtick, ";", "(", ")" or ", "
MESSAGE_COMMAND = re.compile(r"(?:(?:nice|time|/usr/bin/time -v) )*python3? -m launch\.\w+(?:\\\n|,(?! )|[^\n`;(),])*")


def _quoted_commands(text: str):
    """(module, words) of each ``python -m launch.X ...`` quoted inside a message or prose."""
    for command in MESSAGE_COMMAND.findall(text):
        yield from _commands_in(command)


def _all_commands():
    for page in [p for p in PAGES if p != LOG]:
        for span in _prose_code(page):
            found = list(_commands_in(span))
            if any(module == "?" for module, _ in found) and not span.lstrip().startswith(("python", "nice", "time", "/usr")):
                found = list(_quoted_commands(span))  # `error: ... python -m launch.eval ...`: a message quoted in the prose
            for module, words in found:
                if words:  # a bare `python -m launch.bench` is a mention of the module, not a command
                    yield pytest.param(module, words, id=f"{_rel(page)}: {module} {' '.join(words)}"[:150])
    for path in [p for p in SOURCES if p.suffix == ".py"]:
        for line, text in _strings(path):
            for module, words in _quoted_commands(text):
                if words:
                    yield pytest.param(module, words, id=f"{_rel(path)}:{line}: {module} {' '.join(words)}"[:150])


@pytest.mark.parametrize("module, words", list(_all_commands()))
def test_every_command_shown_parses(module, words):
    assert module != "?", f"a launch command in a form tests/doc_commands.py does not know: {words[0]}"
    assert doc_commands.check(module, words, partial=True) is None


def test_a_wrong_flag_a_wrong_key_and_a_wrong_item_are_caught():
    check = doc_commands.check
    assert check("launch.eval", ["--workdir", "runs/tiny", "--lenghts", "256"]) is not None
    assert check("launch.eval", ["--workdir", "runs/tiny", "--lengths", "0"]) is not None
    assert check("launch.train", ["--workdir", "w", "steps=3"]) is None
    assert "did you mean steps" in check("launch.train", ["stpes=3"])
    assert check("launch.eval", ["--workdir", "RUN", "--attention", "windw=8"]) is not None
    assert check("launch.eval", ["--workdir", "RUN", "--rope", "factr=4"]) is not None
    assert check("launch.eval", ["--workdir", "RUN", "--rope", "scaling=yarn", "factor=4", "original_len=256"]) is None
    assert "unknown placeholder" in check("launch.eval", ["--workdir", "RUNN"])
    assert check("launch.eval", ["--workdri", "RUN"], partial=True) is not None  # --workdir missing hides nothing
    assert check("launch.eval", ["--lengths", "256"], partial=True) is None  # a synopsis may leave --workdir out
    with pytest.raises(doc_commands.UnknownForm):
        doc_commands.launch_command(["uv", "run", "-m", "launch.eval", "--lenghts", "4"])
    assert doc_commands.launch_command(["/usr/bin/time", "-v", "nice", "python3", "-m", "launch.eval", "--x"]) == ("launch.eval", ["--x"])


# --- links ------------------------------------------------------------------------------------

HTML_TARGET = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
UNDEFINED_REFERENCE = re.compile(r"\[[^\]\n]+\]\[([^\]\n]*)\]")


def link_targets(page: Path) -> tuple[list[str], list[str]]:
    """(every link and image target of the page, the reference labels used without a definition)."""
    env: dict = {}
    targets, undefined = [], []
    for token in MARKDOWN.parse(page.read_text(), env):
        if token.type == "html_block":
            targets += HTML_TARGET.findall(token.content)
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(child.attrs["href"])
            elif child.type == "image":
                targets.append(child.attrs["src"])
            elif child.type == "html_inline":
                targets += HTML_TARGET.findall(child.content)
            elif child.type == "text":
                undefined += UNDEFINED_REFERENCE.findall(child.content)
    return targets, undefined


def _anchors(page: Path) -> set[str]:
    """GitHub's (and mkdocs') heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def broken_target(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None  # http(s):, mailto:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in _anchors(file):
        return f"{target}: no heading #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve(page):
    targets, undefined = link_targets(page)
    broken = [problem for target in targets if (problem := broken_target(page, target))]
    # [name][fibjax.x.y] is a cross-reference to the API page: mkdocs build --strict resolves it
    broken += [f"[...][{label}]: no definition" for label in undefined if not label.startswith("fibjax.")]
    assert not broken


def test_every_kind_of_link_is_read(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n\n[a](p.md#top) [b][r] [c](q.md 'title') <a href=\"h.md\">h</a> ![i](i.png) [d][none]\n\n[r]: p.md#gone\n")
    targets, undefined = link_targets(page)
    assert sorted(targets) == ["h.md", "i.png", "p.md#gone", "p.md#top", "q.md"] and undefined == ["none"]
    assert sorted(t for t in targets if broken_target(page, t)) == ["h.md", "i.png", "p.md#gone", "q.md"]


DOC_PATH = re.compile(r"\bdocs/[\w/.-]+\.md(?:#[\w-]+)?")


def test_pages_named_in_messages_and_help_texts_exist():
    named = {(_rel(path), m) for path in SOURCES for m in DOC_PATH.findall(path.read_text())}
    assert len(named) >= 3
    assert [f"{where}: {problem}" for where, target in sorted(named) if (problem := broken_target(ROOT / "x", target))] == []


# --- "page, section" references ----------------------------------------------------------

# README "X" / README: "X" / the README's "X" / README section "X", and PAGE.md "X" (a section of it)
README_REF = re.compile(r"README(?:'s)?[,:]? (?:section )?[\"'“]([^\"'”]+)[\"'”]")
PAGE_REF = re.compile(r"`?((?:docs/)?[\w./-]+\.md)`?,? (?:section )?\"([^\"]+)\"")


def _headings(page: Path) -> set[str]:
    return {h.strip().strip("`") for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def _has_section(page: Path, section: str) -> bool:
    """A heading of ``page`` is ``section``, or begins with it ("Semantics" for "Semantics (paper A)")."""
    return page.exists() and any(h == section or h.startswith(f"{section} ") for h in _headings(page))


def _section_refs():
    for path in [*PAGES, *SOURCES]:
        text = path.read_text().replace('\\"', '"')
        for m in README_REF.finditer(text):
            yield _rel(path), ROOT / "README.md", " ".join(m.group(1).split())
        for m in PAGE_REF.finditer(text):
            target = (ROOT / m.group(1)) if (ROOT / m.group(1)).exists() else path.parent / m.group(1)
            yield _rel(path), target, " ".join(m.group(2).split())  # a reference may wrap


def test_section_references_name_headings_that_exist():
    refs = list(_section_refs())
    assert len(refs) >= 5  # the references this project makes, so the patterns still match them
    broken = [f"{where}: {target.name} {section!r}" for where, target, section in refs if not _has_section(target, section)]
    assert not broken


# --- checked outputs --------------------------------------------------------------------------

TEXT_BLOCK = re.compile(r"^ *([^\n]*)\n *```text\n(.*?)^ *```", flags=re.M | re.S)  # in a list item too


def _checked_outputs(page: Path, test: str) -> list[tuple[list[str], str]]:
    """(the command of the shell block above, the block) for each block this test checks."""
    text, out = page.read_text(), []
    for m in TEXT_BLOCK.finditer(text):
        if m.group(1) == f"<!-- output checked by tests/test_docs_drift.py::{test} -->":
            command = re.findall(r"^```bash\n(.*?)\n```", text[: m.start()], flags=re.M | re.S)[-1]
            out.append((command.split()[3:], m.group(2)))
    return out


def test_plan_outputs_shown_in_multi_host_guide(monkeypatch, capsys):
    from launch import plan

    monkeypatch.setenv("XLA_FLAGS", "")  # plan sets its device count; this process has 8 already
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    shown = _checked_outputs(ROOT / "docs" / "guides" / "multi-host.md", "test_plan_outputs_shown_in_multi_host_guide")
    assert len(shown) == 2
    for words, block in shown:
        assert plan.main(words) == 0
        assert capsys.readouterr().out == block, words


# --- the attention reference's headings --------------------------------------------------------


def _signature_in_heading(signature: inspect.Signature) -> list[str]:
    names, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            names.append("*")
            star = True
        names.append(p.name)
    return names


def test_attention_reference_headings_carry_the_real_signatures():
    import fibjax.attention as fa

    text = (ROOT / "docs" / "reference" / "attention.md").read_text()
    calls = re.findall(r"`(\w+)\(([^`]*)\)`", "\n".join(re.findall(r"^### (.+)$", text, flags=re.M)))
    assert len(calls) >= 12
    wrong = []
    for name, params in calls:
        shown = [p.split("=")[0].strip() for p in params.split(",") if p.strip()]
        real = _signature_in_heading(inspect.signature(getattr(fa, name)))
        if shown != real:
            wrong.append(f"{name}({', '.join(shown)}) is {name}({', '.join(real)})")
    assert not wrong


# --- config names promised by a pattern ---------------------------------------------------------


def test_config_name_pattern_matches_the_config_files():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    paragraph = text[text.index("Names: ") :].split("\n\n")[0]
    both, _, cpu_only = paragraph.partition("`configs/cpu/` adds")

    def expand(part: str) -> set[str]:
        names = set()
        for pattern in re.findall(r"`([\w{}|]+)`", part.split(" (")[0] if part is cpu_only else part):
            parts = re.split(r"\{([^}]*)\}", pattern)
            choices = [p.split("|") if i % 2 else [p] for i, p in enumerate(parts)]
            names |= {"".join(c) for c in itertools.product(*choices)}
        return names

    assert expand(both) == {p.stem for p in (ROOT / "configs" / "paper").glob("*.py")}
    assert expand(both) | expand(cpu_only) == {p.stem for p in (ROOT / "configs" / "cpu").glob("*.py")}


# --- timings: one page owns each figure -----------------------------------------------------------

# a topic's wall-clock figures appear on one page; the others link to it (a sentence naming the topic
# and a duration quotes a timing)
TIMING_OWNERS = {
    "the main job": (re.compile(r"python -m launch\.train`? (?:with no arguments|takes|took|ran|runs)|the main job", re.I), "docs/getting-started.md"),
    "the fast tier": (re.compile(r"fast tier[^.]{0,80}?\b(?:took|takes|ran in|runs in|in \d)|-m \"not slow\"", re.I), "docs/dev/testing.md"),
    "sampling": (re.compile(r"launch\.sample\b|new tokens? in", re.I), "docs/guides/sampling.md"),
}
DURATION = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|sec|seconds?|min|minutes?|h|hours?)\b|\b\d+ min \d+ s\b|\b\d+:\d\d\b")
# the README's sampling timing, which the lead moves to its owner (issue 54); remove once it has gone
AWAITING_README_EDIT: dict[str, list[str]] = {}


def quoted_timings(topic: str) -> list[str]:
    pattern, owner = TIMING_OWNERS[topic]
    quoted = []
    for page in [p for p in PAGES if _rel(p) != owner and p != LOG]:
        for paragraph in page.read_text().split("\n\n"):
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):  # a timing of the topic: in one sentence
                if pattern.search(sentence) and (duration := DURATION.search(sentence)):
                    quoted.append(f"{_rel(page)}: {duration.group(0)}")
    return quoted


@pytest.mark.parametrize("topic", TIMING_OWNERS)
def test_each_timing_is_quoted_by_its_owner_only(topic):
    pattern, owner = TIMING_OWNERS[topic]
    assert quoted_timings(topic) == AWAITING_README_EDIT.get(topic, []), f"{topic}'s timings belong in {owner}"
    assert DURATION.search((ROOT / owner).read_text())


# --- the attended-distances figure ----------------------------------------------------------------


def test_the_attended_distances_figure_is_drawn_by_its_command(tmp_path):
    from PIL import Image

    from fibjax.attention import attended_distances
    from fibjax.eval import attended
    from launch import draw_attention

    page = (ROOT / "docs" / "reference" / "attention.md").read_text()
    assert "(../images/attended_distances.png)" in page and "`python -m launch.draw_attention`" in page
    out = tmp_path / "a.png"
    assert draw_attention.main(["--out", str(out)]) == 0
    assert Image.open(out).size == Image.open(ROOT / "docs" / "images" / "attended_distances.png").size
    learned = attended.learned_alphas(ROOT / "results" / "study" / "alpha.csv", "fib_learned_w8")
    panels = attended.paper_panels(8, learned)
    assert [p.title for p in panels][-1] == "fib learned, after training" and panels[-1].alphas == learned
    top_layer = attended_distances(window=8, base="fibonacci", alpha=1.5, seq_len=256)
    assert attended.rung_distances(panels[1], 7, window=8, seq_len=256) == [d for d in top_layer if d > 8]
