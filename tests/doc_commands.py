"""The commands that pages, help texts and messages show, found and checked by the entry points'
real parsers (nothing runs). Shared by the documentation tests (tests/test_doc_pages.py,
tests/test_docs_drift.py).

A command is any shell segment (split at ``&&``, ``||``, ``;``, ``|``, ``&``) that runs a
``launch`` module or script, in any of the forms people write: ``python``, ``python3``,
``.venv/bin/python``; behind ``nice [-n N]``, ``time``, ``/usr/bin/time -v``, ``timeout D``,
``env``, ``sbatch`` and ``VAR=value`` assignments; a ``$ `` prompt (``console`` blocks); lines
joined by ``\\``. A segment that runs ``-m launch.X`` or a launch script behind a program this file does not know
(``uv run -m launch.eval``) is itself a problem, so a new way of writing a command cannot slip
past unchecked.

Placeholders (``RUN``, ``CONFIG``, ``N``, ``[--step S]``, ``{a,b}``, ``...``, an f-string's
``{}``) are replaced by stand-ins of the right kind, so a command with a placeholder is still
parsed; an upper-case word that is not a known placeholder is a problem (a typo or a new one).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex

import pytest

from fibjax import config as config_module
from tests.helpers import ROOT

SEPARATORS = {"&&", "||", ";", "|", "&"}
TRAIN_SCRIPTS = {"launch/local_multiprocess.sh", "launch/slurm_gpu.sbatch", "launch/tpu_pod.sh"}
INTERPRETER = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
# placeholder -> a stand-in the parsers accept (a path need not exist: nothing runs)
PLACEHOLDERS = {
    "RUN": "runs/tiny",
    "WORKDIR": "runs",
    "DIR": "data/mine",
    "OUT": "out",
    "OUT_DIR": "out",
    "DATA": "data/mine",
    "NAME": "tiny",
    "SOURCE": "train",
    "SPEC": "my_corpus",
    "FILES": "my_corpus",
    "FILE": "out.png",
    "MODEL_DIR": "models/llama",
    "TASK": "hellaswag",
    "STUDY": "configs/study/cpu",
    "SUB": "attention",
    "DATASET": "HuggingFaceFW/fineweb",
    "N": "8",
    "S": "100",
    "X": "tiny",
    "A": "a",
    "B": "b",
}
CONFIG_FLAGS = {"--config"}  # a placeholder after these stands for a config file
STAND_IN_CONFIG = "configs/tiny.py"
PLACEHOLDER_WORD = re.compile(r"(?<![\w.-])[A-Z][A-Z0-9_]*(?!\w)")


class UnknownForm(Exception):
    """A segment names a launch module in a form the finder does not know."""


def segments(source: str, prompt: bool = False):
    """The word lists of ``source``'s shell segments (``prompt``: only ``$ `` lines are commands)."""
    for line in source.replace("\\\n", " ").splitlines():
        line = line.strip()
        if prompt:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        segment: list[str] = []
        for word in [*words, ";"]:
            if word in SEPARATORS:
                if segment:
                    yield segment
                segment = []
            else:
                segment.append(word)


def _strip_wrappers(words: list[str]) -> tuple[dict, list[str]]:
    env: dict[str, str] = {}
    while words:
        head = words[0]
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", head):
            key, _, value = head.partition("=")
            env[key] = value
            words = words[1:]
        elif head in ("nice", "env", "exec", "sbatch", "srun", "command", "bash", "sh"):
            words = words[1:]
            while words and head in ("nice", "sbatch", "srun") and words[0].startswith("-"):
                words = words[2:] if words[0] == "-n" else words[1:]
        elif head in ("time", "/usr/bin/time"):
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[1:]
        elif head == "timeout":
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[2:] if words[0] in ("-s", "-k", "--signal", "--kill-after") else words[1:]
            words = words[1:]  # the duration
        else:
            break
    return env, words


def launch_command(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, argument words) when ``words`` run a launch module or script; None when they run
    something else. Raises UnknownForm when they name one in a form not known here."""
    env, rest = _strip_wrappers(words)
    rest = [w for w in rest if not re.match(r"^\d?>>?", w)]  # redirections
    if len(rest) >= 3 and INTERPRETER.match(rest[0]) and rest[1] == "-m" and rest[2].startswith("launch."):
        return rest[2], rest[3:]
    if rest and rest[0].removeprefix("./") in TRAIN_SCRIPTS:
        return env.get("MODULE", "launch.train"), rest[1:]
    named = [i for i, w in enumerate(rest) if w == "-m" and i + 1 < len(rest) and rest[i + 1].startswith("launch.")]
    if named or (rest[1:] and any(w.removeprefix("./") in TRAIN_SCRIPTS for w in rest[1:])):
        raise UnknownForm(" ".join(words))
    return None


def stand_ins(words: list[str]) -> list[str]:
    """``words`` with placeholders replaced; raises ValueError naming an unknown placeholder."""
    out = []
    for i, word in enumerate(words):
        if word.startswith("[lm-eval"):
            continue
        word = word.strip("[]")
        if word in ("...", "…") and i and re.fullmatch(r"--[\w-]+", words[i - 1]):
            word = "x"  # `--prompt "..."`: an elided value
        if word in ("...", "…", "key=value", "options"):
            continue
        word = re.sub(r"\[([^\]]*)\]", r"\1", word)  # NAME=DIR[:SOURCE]
        if choice := re.fullmatch(r"\{([\w-]+),[\w,-]+\}", word):
            word = choice.group(1)
        previous = words[i - 1].strip("[") if i else ""
        if previous in CONFIG_FLAGS and (PLACEHOLDER_WORD.search(word) or "{}" in word):
            out.append(STAND_IN_CONFIG)
            continue
        word = word.replace("{}", "x")
        for name in PLACEHOLDER_WORD.findall(word):
            if name not in PLACEHOLDERS:
                raise ValueError(f"unknown placeholder {name!r} (tests/doc_commands.py PLACEHOLDERS)")
        out.append(PLACEHOLDER_WORD.sub(lambda m: PLACEHOLDERS[m.group(0)], word))
    return out


# --- the real parsers -------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser an entry point built."""


def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser ``launch.X.main`` builds, caught as it starts parsing (nothing runs)."""

    def grab(parser, *args, **kwargs):
        raise _Parsed(parser)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", grab)
        m.setattr(argparse.ArgumentParser, "parse_known_args", grab)
        with pytest.raises(_Parsed) as parsed:
            importlib.import_module(module).main([])
    return parsed.value.args[0]


def parse(module: str, words: list[str]) -> tuple[argparse.Namespace | None, str | None]:
    """(the parsed arguments, None), or (None, the error) the real parser of ``module`` gives.
    Words left over must be ``key=value`` overrides, and only where the command takes them."""
    parser = parser_of(module)
    for each in [parser, *(c for a in parser._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values())]:
        each.allow_abbrev = False  # a page shows the whole flag: `--workdi` would work today and break with a new flag
    words = ["run", *words] if module == "launch.harness" else words  # lm-eval's parser; harness implies its `run`
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = parser.parse_known_args(words)
    except SystemExit as e:
        return None, (None if e.code == 0 else err.getvalue().strip() or f"exit {e.code}")  # 0: --help
    stray = [w for w in extra if w.startswith("-") or "=" not in w]
    if stray or (extra and not hasattr(args, "overrides")):
        return None, f"unrecognized: {stray or extra}"
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args, None


def option_strings(module: str) -> set[str]:
    """Every flag the parser of ``module`` (and its subcommands') knows."""
    parsers = [parser_of(module)]
    parsers += [c for a in parsers[0]._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    return {option for each in parsers for action in each._actions for option in action.option_strings}


def parse_error(module: str, words: list[str]) -> str | None:
    return parse(module, words)[1]


def apply_config(words: list[str], module: str = "launch.train"):
    """The config a launch.train / launch.plan command line resolves to (no JAX, no run)."""
    args, error = parse(module, words)
    if error:
        raise config_module.ConfigError(error)
    if args is None:  # --help
        return None
    return config_module.apply_overrides(config_module.load_config_file(ROOT / (args.config or "configs/tiny.py")), args.overrides)


# a command quoted in prose or a message may show only some of its flags
MISSING_REQUIRED = re.compile(r"the following arguments are required|one of the arguments .* is required")


def check(module: str, words: list[str], partial: bool = False) -> str | None:
    """What is wrong with ``python -m module words`` (None: nothing): the real parser's error,
    a config key or value the config tree refuses, or an ``--attention`` / ``--rope`` item its
    validator refuses (checked against the tiny config's model). ``partial``: a synopsis, whose
    missing required flags are not an error (every flag and value it does show still is)."""
    if not re.fullmatch(r"launch\.[a-z_]+", module):
        return None  # `python -m launch.NAME`, `launch.*`: the module itself is a placeholder
    try:
        words = stand_ins(words)
    except ValueError as e:
        return str(e)
    if module not in ("launch.harness",) and module.removeprefix("launch.") not in _modules():
        return f"no module {module}"
    args, error = parse(module, words)
    if error and partial and MISSING_REQUIRED.search(error):
        # argparse stops at the missing flag before it looks at the others: look at them here
        unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in option_strings(module)]
        return f"unrecognized: {unknown}" if unknown else None
    if error or args is None:
        return error
    try:
        if module in ("launch.train", "launch.plan"):
            apply_config(words, module)
        model = config_module.load_config_file(ROOT / "configs" / "tiny.py").model
        if getattr(args, "attention", None):
            config_module.apply_overrides(model.attention, args.attention)
        if getattr(args, "rope", None):
            from fibjax.eval.runner import rope_overrides

            config_module.apply_overrides(model, rope_overrides(args.rope))
    except config_module.ConfigError as e:
        return str(e)
    return None


def _modules() -> set[str]:
    return {p.stem for p in (ROOT / "launch").glob("*.py") if not p.stem.startswith("_")}
