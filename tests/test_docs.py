"""The documentation under docs/ stays true: the generated config reference is current, the API
reference's examples and the attention guide's code run and check their outputs, every relative
link resolves, and every command a page shows names flags and config keys that exist."""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import re
import shlex
from pathlib import Path

import pytest

from fibjax import config as config_module
from fibjax import config_reference
from tests.helpers import ROOT
from tests.tiers import slow

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def test_config_reference_is_current():
    committed = (DOCS / "reference" / "config.md").read_text()
    assert committed == config_reference.render(), "docs/reference/config.md is stale: run python -m fibjax.config_reference"


def test_config_reference_covers_every_field():
    text = config_reference.render()

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            child = config_reference._section_type(cls, f.name)
            yield from keys(child, f"{prefix}{f.name}.") if child else (f"{prefix}{f.name}",)

    missing = [k for k in keys(config_module.TrainConfig) if f"| `{k}` |" not in text]
    assert not missing


@dataclasses.dataclass(frozen=True)
class _Inner:
    """An inner section."""

    # how wide | with a pipe and <angle brackets>
    width: int = 3
    flag: bool = False  # set it


@dataclasses.dataclass(frozen=True)
class _Outer:
    """The root."""

    # the run's name
    name: str = "x"
    inner: _Inner = dataclasses.field(default_factory=_Inner)


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    """A field below has no comment."""

    # documented
    a: int = 1
    b: int = 2


def test_reference_rows_carry_key_type_default_and_comment():
    text = config_reference.render(_Outer, header="")
    assert "## Top level (_Outer)\n\nThe root.\n" in text
    assert "| `name` | `str` | `'x'` | the run's name |" in text
    assert "## `inner` (_Inner)\n\nAn inner section.\n" in text
    assert "| `inner.width` | `int` | `3` | how wide \\| with a pipe and &lt;angle brackets> |" in text
    assert "| `inner.flag` | `bool` | `False` | set it |" in text


def test_a_field_without_a_comment_is_an_error_naming_it():
    with pytest.raises(config_reference.UndocumentedField, match=r"_Undocumented\.b \(b\)"):
        config_reference.render(_Undocumented, header="")


def test_check_mode_fails_on_a_stale_reference(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(config_reference.render().replace("| `seed` |", "| `sed` |"))
    monkeypatch.setattr(config_reference, "OUT", stale)
    assert config_reference.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0


ATTENTION_REFERENCE = DOCS / "reference" / "attention.md"


def _run_doctests(path: Path, stop_at: str | None = None) -> doctest.TestResults:
    """The page's ``>>>`` examples in order, in one namespace, up to the line ``stop_at`` (all: None)."""
    text = path.read_text()
    if stop_at is not None:
        assert stop_at in text.splitlines(), stop_at
        text = text[: text.index(f"\n{stop_at}\n")]
    test = doctest.DocTestParser().get_doctest(text, {}, path.name, str(path), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = io.StringIO()
    runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()
    return runner.summarize(verbose=False)


def test_attention_reference_examples_run_up_to_the_first_path():
    """The fast tier's share: the conventions, the attended set and offset_attention (about 3 s of
    CPU with a cold compilation cache; the whole page takes about 15 s: slow tier)."""
    results = _run_doctests(ATTENTION_REFERENCE, stop_at="### `interpolated_attention(q, k, v, *, window, base, alpha, return_lse=False, implementation=None)`")
    assert results.attempted >= 20


@slow
def test_attention_reference_examples_run():
    results = _run_doctests(ATTENTION_REFERENCE)
    assert results.attempted >= 40


def test_attention_reference_names_every_public_function():
    import fibjax.attention as fa

    text = ATTENTION_REFERENCE.read_text()
    assert [name for name in fa.__all__ if f"`{name}" not in text] == []


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@slow
def test_attention_guide_code_runs(tmp_path, monkeypatch):
    """The guide's code as one script, in a scratch directory (it trains a run in runs/recent);
    the attention kind it registers is removed afterwards, so other tests see the built-in ones."""
    from fibjax import kinds

    blocks = _python_blocks(DOCS / "guides" / "attention-in-your-model.md")
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "attention_guide"}
    try:
        for block in blocks:
            exec(compile(block, "attention-in-your-model.md", "exec"), namespace)
    finally:
        kinds.unregister("recent")
    assert (tmp_path / "runs" / "recent" / "eval" / "6-len_32_64.json").is_file()


# --- links and commands -----------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", flags=re.S | re.M)
SEPARATORS = {"&&", "||", ";", "|", "&"}
TRAIN_SCRIPTS = {"launch/local_multiprocess.sh", "launch/slurm_gpu.sbatch", "launch/tpu_pod.sh"}
FLAGS_WITHOUT_VALUE = {"--no-progress", "--no-compile"}  # launch.train's and launch.plan's


def _commands(page: Path):
    """(module, argument words) of every ``python -m launch.X`` (or launch script) in a shell block."""
    for block in SHELL_BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            segment: list[str] = []
            for word in [*words, ";"]:
                if word not in SEPARATORS:
                    segment.append(word)
                    continue
                if found := _launch_command(segment):
                    yield found
                segment = []


def _launch_command(words: list[str]):
    env = {}
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] in ("nice", "time", "sbatch") or words[0].lstrip("-").isdigit() or words[0] == "-n"):
        if "=" in words[0]:
            key, _, value = words[0].partition("=")
            env[key] = value
        words = words[1:]
    words = [w for w in words if not re.match(r"^\d?>", w)]  # redirections
    if len(words) >= 3 and words[0] == "python" and words[1] == "-m" and words[2].startswith("launch."):
        return words[2], words[3:]
    if words and words[0] in TRAIN_SCRIPTS:
        return env.get("MODULE", "launch.train"), words[1:]
    return None


def _help(module: str, words: list[str]) -> str:
    """``python -m MODULE [subcommand] --help``, run in this process (argparse prints and exits)."""
    import importlib

    main = importlib.import_module(module).main
    subcommand = [w for w in words[:1] if not w.startswith("-") and "=" not in w and "/" not in w]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*subcommand, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_commands_use_existing_flags_and_config_keys(page):
    problems = []
    for module, words in _commands(page):
        known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", _help(module, words)))
        problems += [f"{module} {w}" for w in words if w.startswith("--") and w.split("=")[0] not in known]
        if module in ("launch.train", "launch.plan"):
            try:
                _apply(words)
            except config_module.ConfigError as e:
                problems.append(f"{module} {' '.join(words)}: {e}")
    assert not problems


def _apply(words: list[str]):
    """The config a launch.train / launch.plan command line resolves to (no JAX, no run)."""
    config_file, overrides, skip = ROOT / "configs" / "tiny.py", [], False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word == "--config":
            config_file, skip = ROOT / words[i + 1], True
        elif word.startswith("--"):
            skip = word not in FLAGS_WITHOUT_VALUE
        elif "=" in word:
            overrides.append(word)
    return config_module.apply_overrides(config_module.load_config_file(config_file), overrides)
