"""Run lm-evaluation-harness tasks on a run: ``python -m launch.harness --model_args workdir=RUN --tasks TASK [lm-eval options]``.

The arguments are ``python -m lm_eval run``'s, with ``--model fibjax`` (``fibjax.eval.harness``)
and ``--batch_size auto`` implied. Needs the harness extra: ``pip install -e ".[harness]"``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from fibjax.errors import FibjaxError
    from fibjax.eval.harness import main as harness_main

    try:
        harness_main(argv)
    except FibjaxError as e:  # the run cannot be loaded (no such run or step, its data changed)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
