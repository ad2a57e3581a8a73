"""Run lm-evaluation-harness tasks on a run: ``python -m launch.harness --model_args workdir=RUN --tasks TASK [lm-eval options]``.

The arguments are ``python -m lm_eval run``'s, with ``--model fibjax`` (``fibjax.eval.harness``)
and ``--batch_size auto`` implied. Needs the harness extra: ``pip install -e ".[harness]"``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from fibjax.eval.harness import main as harness_main

    harness_main(argv)


if __name__ == "__main__":
    main()
