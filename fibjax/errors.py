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
