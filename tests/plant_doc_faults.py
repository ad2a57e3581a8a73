"""Plant documentation mistakes, one at a time, into a scratch copy of the repository, run the
documentation tests there, and report which were caught (some test failed) and which missed.

    nice python -m tests.plant_doc_faults            # all of them (3 min 17 s on 2 busy cores)
    nice python -m tests.plant_doc_faults --only 4,17

The mistakes are the 25 variants of issue 54 that the hand-written drift tests let through: each is
a near variant of a mistake those tests did catch. The copy holds the working tree's files (not
runs/ or data/, nor ignored files); the unplanted copy must pass first, or nothing below means anything. Exit status
0 when every plant was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = {"data", "runs", ".git"}  # prepared data and runs: no documentation test reads them
DOC_TESTS = ["tests/test_doc_pages.py", "tests/test_docs_drift.py", "tests/test_doc_outputs.py"]  # with -x: the quickest first
PAGE = "docs/faq.md"  # where a planted page mistake is appended


@dataclass(frozen=True)
class Plant:
    what: str
    file: str
    old: str | None  # None: append ``new`` to the file
    new: str


def _block(language: str, body: str, marker: str = "", indent: str = "") -> str:
    lines = [marker] if marker else []
    lines += [f"```{language}", *body.splitlines(), "```"]
    return "\n" + "".join(f"{indent}{line}\n" if line else "\n" for line in ["", *lines])


PLANTS = [
    Plant(
        "an indented bash block (in a list item) with a misspelt flag",
        PAGE,
        None,
        "\n- Again:\n" + _block("bash", "python -m launch.eval --workdir runs/tiny --lenghts 256", indent="    "),
    ),
    Plant("`python3 -m` with a misspelt flag", PAGE, None, _block("bash", "python3 -m launch.eval --workdir runs/tiny --lenghts 256")),
    Plant("`/usr/bin/time -v` before a misspelt flag", PAGE, None, _block("bash", "/usr/bin/time -v python -m launch.train --no-progess")),
    Plant("a placeholder (`RUN`) in a command with a misspelt flag", PAGE, None, _block("bash", "python -m launch.eval --workdir RUN --lenghts 256")),
    Plant("a bad key after `--attention`", PAGE, None, _block("bash", "python -m launch.eval --workdir runs/tiny --attention kind=offset windw=8")),
    Plant("a bad key after `--rope`", PAGE, None, _block("bash", "python -m launch.eval --workdir runs/tiny --rope scaling=yarn factr=4 original_len=256")),
    Plant("a command in an error message with a misspelt flag", "launch/train.py", "python -m launch.eval --workdir {", "python -m launch.eval --workdri {"),
    Plant("a command in a help text with a misspelt flag", "launch/train.py", "[--config configs/X.py]", "[--confg configs/X.py]"),
    Plant("a reference-style link to a missing page", PAGE, None, "\nSee [the guide][g].\n\n[g]: guides/no-such-page.md\n"),
    Plant("an HTML link to a missing page", PAGE, None, '\nSee <a href="guides/no-such-page.md">the guide</a>.\n'),
    Plant("a link with a single-quoted title to a missing page", PAGE, None, "\nSee [the guide](guides/no-such-page.md 'the guide').\n"),
    Plant("a missing anchor on a doc path in a message", "launch/harness.py", None, "\n# see docs/faq.md#no-such-section\n"),
    Plant(
        "an example output block's figure changed (a copy of the main job's table)",
        "docs/guides/evaluating-and-extrapolation.md",
        "| python_docs | 1024 | 7168 | 4.5958 | 99.07 | -0.2% |",
        "| python_docs | 1024 | 7168 | 4.5968 | 99.07 | -0.2% |",
    ),
    Plant("an output block marked as an example without its run", PAGE, None, _block("text", "nothing to report", marker="<!-- example output -->")),
    Plant("a `console` block with a misspelt flag", PAGE, None, _block("console", "$ python -m launch.eval --workdir runs/tiny --lenghts 256")),
    Plant("an unlabelled block with a misspelt flag", PAGE, None, _block("", "python -m launch.eval --workdir runs/tiny --lenghts 256")),
    Plant("a figure in the README's Markdown table", "README.md", "| NLL | 4.5980 |", "| NLL | 4.5981 |"),
    Plant("a figure in the README's `fit` line", "README.md", "validation NLL 4.606", "validation NLL 4.607"),
    Plant("a figure in getting-started's `fit` line", "docs/getting-started.md", "training loss 3.109", "training loss 3.119"),
    Plant("the main job's timing in seconds on another page", PAGE, None, "\nThe main job finished in 680 s here.\n"),
    Plant("the main job's timing in hours on another page", PAGE, None, "\nThe main job took 1.5 hours on a laptop.\n"),
    Plant("the main job's timing after `takes`", PAGE, None, "\n`python -m launch.train` takes 12 min on a laptop.\n"),
    Plant(
        "an output block 'checked by' a test that does not read its page",
        PAGE,
        None,
        _block(
            "text",
            "fib_stagger_w12: 16 layers",
            marker="<!-- output checked by tests/test_docs_drift.py::test_config_name_pattern_matches_the_config_files -->",
        ),
    ),
    Plant(
        "prepare_data's summary line without `, documents tokens + EOS 1`",
        "docs/guides/your-own-data.md",
        "d4cfbf0499e3, documents tokens + EOS 1\n",
        "d4cfbf0499e3\n",
    ),
    Plant(
        "a sampling timing on a page other than sampling.md", "docs/getting-started.md", None, "\n`python -m launch.sample` wrote 64 new tokens in 17.9 s.\n"
    ),
]


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked files (not ignored ones), less LEFT_OUT."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in sorted({line.split("/")[0] for line in listed.stdout.splitlines()} - LEFT_OUT):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def run_tests(copy: Path) -> tuple[bool, str]:
    """(passed, the first failing test's id), running the documentation tests' fast tier in ``copy``."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *DOC_TESTS]
    result = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    return result.returncode == 0, (failed[0] if failed else result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-300:])


def plant(copy: Path, p: Plant) -> str:
    """Apply ``p`` to ``copy``; returns the file's text before, to restore it."""
    path = copy / p.file
    before = path.read_text()
    if p.old is None:
        path.write_text(before + p.new)
    else:
        assert before.count(p.old) == 1, f"{p.file}: {p.old!r} found {before.count(p.old)} times"
        path.write_text(before.replace(p.old, p.new))
    return before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.plant_doc_faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated plant numbers (1-based); default: all")
    args = parser.parse_args(argv)
    chosen = [int(n) for n in args.only.split(",") if n] or list(range(1, len(PLANTS) + 1))
    with tempfile.TemporaryDirectory(prefix="plant-doc-faults-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        found = subprocess.run(
            [sys.executable, "-c", "import fibjax, launch; print(fibjax.__file__, launch.__file__)"],
            cwd=copy,
            env={**os.environ, "PYTHONPATH": str(copy)},
            capture_output=True,
            text=True,
        )
        assert found.stdout.startswith(str(copy)), f"the copy's tests would import another fibjax: {found.stdout}"
        start = time.monotonic()
        passed, detail = run_tests(copy)
        print(f"unplanted copy: {'passes' if passed else 'FAILS: ' + detail} ({time.monotonic() - start:.0f} s)", flush=True)
        if not passed:
            return 2
        print("| # | planted | result | first failing test |\n|---:|---|---|---|", flush=True)
        missed = 0
        for n in chosen:
            p = PLANTS[n - 1]
            before = plant(copy, p)
            try:
                passed, detail = run_tests(copy)
            finally:
                (copy / p.file).write_text(before)
            missed += passed
            print(f"| {n} | {p.what} ({p.file}) | {'MISSED' if passed else 'caught'} | {'' if passed else detail} |", flush=True)
        print(f"{len(chosen) - missed} of {len(chosen)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
