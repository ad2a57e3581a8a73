"""Output blocks that a test regenerates, and the copies of one run's output that pages quote: a
copy must agree with the page that owns it (docs/getting-started.md owns the main job's `fit`
line, its evaluation table and its "nothing to do" line), digit for digit."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OWNER = ROOT / "docs" / "getting-started.md"


def fenced(page: Path, language: str) -> list[tuple[str, str, int]]:
    """(marker line above, block text unindented, end offset) of every ``language`` block."""
    text = page.read_text()
    out = []
    for m in re.finditer(rf"^([ \t]*)([^\n]*)\n([ \t]*)```{language}\n(.*?)^\3```", text, flags=re.M | re.S):
        indent = m.group(3)
        body = "".join(line.removeprefix(indent) for line in m.group(4).splitlines(keepends=True))
        out.append((m.group(2).strip(), body, m.end()))
    return out


def checked_blocks(page: Path, test: str) -> list[tuple[str, str]]:
    """(the shell block above, the output block) for each block marked as checked by ``test``."""
    out = []
    for marker, body, end in fenced(page, "text"):
        if marker.endswith(f"::{test} -->"):
            shell = [b for _, b, e in fenced(page, "bash") if e < end][-1]
            out.append((shell, body))
    return out


def test_prepare_data_output_on_your_own_data_page(tmp_path, capsys, monkeypatch):
    """The guide's first commands, run as shown in a scratch directory: the corpus written by its
    shell line, then launch.prepare_data, whose summary must be the page's block."""
    from launch import prepare_data
    from tests.doc_commands import launch_command, segments

    page = ROOT / "docs" / "guides" / "your-own-data.md"
    [(shell, block)] = checked_blocks(page, "test_prepare_data_output_on_your_own_data_page")
    ran = 0
    for line in shell.splitlines():
        found = [launch_command(words) for words in segments(line)]
        if any(found):
            [(module, words)] = [f for f in found if f]
            assert module == "launch.prepare_data"
            capsys.readouterr()
            monkeypatch.chdir(tmp_path)
            assert prepare_data.main([*words, "--quiet"]) == 0
            ran += 1
        else:
            subprocess.run(line, shell=True, cwd=tmp_path, check=True)
    assert ran == 1
    assert capsys.readouterr().out == block


# --- copies of the main job's output -------------------------------------------------------------

# the figures of a fit line, wherever a page quotes them
FIT_FIGURES = re.compile(r"training loss [\d.]+ \(mean of the last \d+ steps\), validation NLL [\d.]+ \(\w+; perplexity [\d.]+\), a gap of [+-][\d.]+ nats")
ROW = re.compile(r"^\| python_docs \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|", re.M)
PLAIN_RUN = "tiny (runs/tiny) step 200 (trained at 256 tokens)\n"


def owner_fit_line() -> str:
    [(marker, body, _)] = [b for b in fenced(OWNER, "text") if b[1].startswith("fit at step")]
    return " ".join(body.split())


def owner_block() -> str:
    [body] = [b for _, b, _ in fenced(OWNER, "text") if b.startswith(PLAIN_RUN)]
    return body


def _alphas(body: str) -> str | None:
    found = re.search(r"^alpha per layer: .*$", body, flags=re.M)
    return found and found.group(0)


def owner_rows() -> dict[int, tuple[str, str, str]]:
    """length -> (tokens, NLL, ppl) of the main job's evaluation table on the owner page."""
    return {int(m[0]): m[1:] for m in ROW.findall(owner_block())}


def test_every_copy_of_the_fit_line_is_the_owners():
    owner = owner_fit_line()
    copies = []
    for page in PAGES:
        text = " ".join(page.read_text().split())
        copies += [(page, m) for m in FIT_FIGURES.findall(text)]
    assert len(copies) >= 2  # the owner's, and the README's
    assert [str(p.relative_to(ROOT)) for p, copy in copies if copy not in owner] == []


def test_every_copy_of_the_main_jobs_table_is_the_owners():
    """Plain evaluations of the main job's run (its table rows wherever a page shows them) and
    the README's Markdown table of NLL and perplexity by length."""
    owner = owner_rows()
    assert set(owner) == {256, 512, 1024}
    wrong = []
    for page in PAGES:
        for _, body, _ in fenced(page, "text"):
            if body.startswith(PLAIN_RUN) and _alphas(body) == _alphas(owner_block()):  # the same weights and attention
                for length, *row in ROW.findall(body):  # the same tokens scored at the same length
                    if int(length) in owner and row[0] == owner[int(length)][0] and tuple(row) != owner[int(length)]:
                        wrong.append(f"{page.name} {length}")
    readme = (ROOT / "README.md").read_text()
    header = re.search(r"^\| python_docs \|((?: [\d,]+ tokens \|)+)$", readme, flags=re.M)
    lengths = [int(x.replace(",", "")) for x in re.findall(r"([\d,]+) tokens", header.group(1))]
    nll = re.search(r"^\| NLL \|(.*)\|$", readme, flags=re.M).group(1).split("|")
    ppl = re.search(r"^\| perplexity \|(.*)\|$", readme, flags=re.M).group(1).split("|")
    for length, n, p in zip(lengths, nll, ppl, strict=True):
        if (n.strip(), p.strip()) != owner[length][1:]:
            wrong.append(f"README.md {length}")
    assert not wrong


def test_every_copy_of_nothing_to_do_is_the_owners():
    [owner] = [b for _, b, _ in fenced(OWNER, "text") if b.startswith("nothing to do:")]
    copies = [(page, b) for page in PAGES for _, b, _ in fenced(page, "text") if b.startswith("nothing to do: runs/tiny")]
    assert len(copies) >= 2
    assert [p.name for p, b in copies if b != owner] == []
