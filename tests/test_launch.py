"""The entry points as a user meets them: ``python -m launch`` lists only what runs, and every
option of every entry point says what it does in ``--help``."""

import argparse
import contextlib
import importlib
import io
import subprocess
import sys

import pytest

from launch.__main__ import entry_points
from tests.helpers import ROOT, TINY

# lm-eval's own parser: its options and their help are lm-eval's, not this project's
FOREIGN_PARSERS = {"harness"}


def test_python_m_launch_lists_only_modules_that_run():
    out = subprocess.run([sys.executable, "-m", "launch"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert listed == list(entry_points()) and "processes" not in listed  # a helper of train/eval/passkey: it prints nothing
    for name in listed:
        module = importlib.import_module(f"launch.{name}")
        assert callable(getattr(module, "main", None)), name
        with contextlib.redirect_stdout(io.StringIO()) as help_text, pytest.raises(SystemExit) as exit_:
            module.main(["--help"])
        assert exit_.value.code == 0 and "usage:" in help_text.getvalue(), name


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser an entry point built."""


def _parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    def grab(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(f"launch.{name}").main([])
    return parsed.value.args[0]


def _options_without_help(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                missing += _options_without_help(subparser, f"{prefix}{sub} ")
        elif not (action.help or "").strip():
            missing.append(prefix + "/".join(action.option_strings or [action.dest]))
    return missing


@pytest.mark.parametrize("name", sorted(set(entry_points()) - FOREIGN_PARSERS))
def test_every_option_has_help(name, monkeypatch):
    assert _options_without_help(_parser_of(name, monkeypatch)) == [], name


def test_plan_says_it_is_compiling_before_it_compiles(monkeypatch, capsys):
    from launch import plan

    monkeypatch.setenv("XLA_FLAGS", "")  # plan appends its device count; this process has 8 devices already
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    small = [o for o in TINY if not o.startswith("mesh.")]
    assert plan.main(["--config", str(ROOT / "configs" / "tiny.py"), "--devices", "8", *small, "mesh.data=8"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("compiling tiny's training step for 8 simulated CPU devices to measure its memory") and "--no-compile skips it" in err
    assert "peak estimate" in out
    assert plan.main(["--config", str(ROOT / "configs" / "tiny.py"), "--devices", "8", "--no-compile", *small, "mesh.data=8"]) == 0
    assert "compiling" not in capsys.readouterr().err
