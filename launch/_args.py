"""Argument parsing shared by the entry points: comma-separated lists, and ``key=value``
overrides anywhere among the flags. Kept free of JAX, so that arguments are checked first."""

from __future__ import annotations

import argparse
import os
import sys

_KINDS = {int: "integers", float: "numbers", str: "names"}


def comma_list(kind, *, minimum=None, noun: str = "value", why: str = ""):
    """An argparse type: ``"256,512"`` -> ``[256, 512]``. An empty item (``256,,512``, a comma at
    either end) is refused rather than dropped: it is a typo, not a shorter list. ``minimum``:
    the smallest value allowed (``why`` says why, in the error)."""

    def parse(text: str) -> list:
        items = text.split(",")
        if any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item (two commas in a row, or one at an end)")
        try:
            values = [kind(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {_KINDS[kind]}, got {text!r}") from None
        if minimum is not None and min(values) < minimum:
            raise argparse.ArgumentTypeError(f"every {noun} must be >= {minimum}{f' ({why})' if why else ''}, got {text!r}")
        return values

    return parse


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` for a parser (or sub-command) with a positional ``overrides``
    (``nargs="*"``), taking ``key=value`` words anywhere among the flags: argparse alone takes a
    positional list in one run, so ``--workdir W steps=3 --no-progress mesh.devices=1`` left
    ``mesh.devices=1`` "unrecognized". Their order is kept (a key given twice takes its last value);
    a word that is not ``key=value`` is left to the config's own error."""
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: argparse's own prints the whole usage block
    (13 lines for launch.eval) above the ``error:`` line, burying it."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (python -m {self.prog.removeprefix('python -m ')} --help lists the options)\n")


def fibjax_or_exit(prog: str) -> None:
    """Exit 2 with one line when the ``fibjax`` Python finds is not this project's package: a
    folder named ``fibjax/`` in the directory a command runs from comes first on Python's path
    and hides the installed package (before, a raw ModuleNotFoundError or ImportError)."""
    try:
        import fibjax.errors  # noqa: F401
    except ImportError as e:
        if not (e.name or "fibjax").startswith("fibjax"):
            raise
        found = sys.modules.get("fibjax")
        where = getattr(found, "__file__", None) or next(iter(getattr(found, "__path__", [])), "?")
        print(
            f"error: the fibjax Python finds is {where}, not fibjax's package ({e}): a folder named fibjax/ in the directory you run "
            f"from ({os.getcwd()}) comes first on Python's path; run python -m {prog} from another directory (a clone's root), or rename that folder",
            file=sys.stderr,
        )
        sys.exit(2)
