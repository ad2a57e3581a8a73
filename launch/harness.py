"""Run lm-evaluation-harness tasks on a run: ``python -m launch.harness --model_args workdir=RUN --tasks TASK [lm-eval options]``.

The arguments are ``python -m lm_eval run``'s, with ``--model fibjax`` (``fibjax.eval.harness``)
and ``--batch_size auto`` implied. Needs the harness extra: ``pip install "fibjax[harness]"``
(in a clone, ``pip install -e ".[harness]"``); without it, one ``error:`` line says so (exit 2).
"""

from __future__ import annotations

import importlib.util
import sys


def main(argv: list[str] | None = None) -> int:
    from fibjax.errors import FibjaxError, pip_install

    try:
        found = importlib.util.find_spec("lm_eval") is not None
    except ValueError:  # a module set to None in sys.modules: hidden, as if not installed
        found = False
    if not found:
        print(f"error: launch.harness needs EleutherAI's lm-evaluation-harness (the harness extra): {pip_install('harness')}", file=sys.stderr)
        return 2
    from fibjax.eval.harness import main as harness_main

    try:
        harness_main(argv)
    except FibjaxError as e:  # the run cannot be loaded (no such run or step, its data changed)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
