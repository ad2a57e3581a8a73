"""The base of every error fibjax raises for bad input or a run that cannot go on.

Each error class subclasses ``FibjaxError`` and keeps its built-in base (``ValueError`` for bad
input, ``RuntimeError`` for a run that cannot go on), so ``except ValueError`` keeps working.
Its message says what is wrong and what to do, in one line a user can act on: the entry points
in ``launch/`` catch ``FibjaxError`` once and print it as ``error: <message>``. An exception
that is not a ``FibjaxError`` is a bug (or a signal), and keeps its traceback.
"""

from __future__ import annotations


class FibjaxError(Exception):
    """A fibjax error: the message names the problem and what to do about it."""


def pip_install(extra: str) -> str:
    """The command that adds an optional extra, in the form that fits how fibjax was installed:
    ``pip install -e ".[hf]"`` in a clone (the package sits beside its ``pyproject.toml``),
    ``pip install "fibjax[hf]"`` for an installed wheel. Remedies in messages use it, so a wheel
    user is not told to run a command that needs a source tree."""
    from pathlib import Path

    in_clone = (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file()
    return f'pip install -e ".[{extra}]"' if in_clone else f'pip install "fibjax[{extra}]"'
