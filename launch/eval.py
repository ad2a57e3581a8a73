"""Evaluate a run: ``python -m launch.eval --workdir RUN [--step S] [--lengths 1024,2048,4096]
[--data NAME=DIR[:SOURCE] ...] [--attention key=value ...] [--rope key=value ...]``.

Perplexity on the same validation tokens at every length, NLL in 8 position bins, the alpha
of every layer; writes RUN/eval/<step>.json and prints a table. ``--attention`` evaluates the
weights under another attention (e.g. ``--attention kind=offset window=8 alpha=staggered``);
``--rope`` under another RoPE (e.g. ``--rope scaling=yarn factor=4 original_len=256``, or
``--rope theta=40000``), so extrapolation with and without scaling is one command each.

On a pod, run the same command on every host (``--coordinator/--num-processes/--process-id``
where no scheduler is detected, as for ``launch.train``): the windows are split over every
device of the job, and process 0 prints and writes the report.
"""

from __future__ import annotations

import argparse
import re
import sys

from launch import processes
from launch._args import Parser, comma_list, fibjax_or_exit
from launch._streams import survive_closed_pipes

MIN_LENGTH = 8  # one token per position bin of the NLL-by-position report


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tag(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.,+=-]+", text):
        raise argparse.ArgumentTypeError(f"a tag is part of a file name: letters, digits and _.,+=- only, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/) to evaluate")
    parser.add_argument("--step", type=_positive, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument(
        "--lengths",
        type=comma_list(int, minimum=MIN_LENGTH, noun="length", why="one token per position bin"),
        default=None,
        help="default: the run's eval.length_multipliers x its seq_len",
    )
    parser.add_argument("--data", action="append", default=[], help="NAME=DIR[:SOURCE], a prepared dataset (default: the run's own validation data)")
    parser.add_argument("--max-tokens", type=_positive, default=None, help="tokens scored per dataset (default: the run's eval.max_tokens)")
    parser.add_argument("--attention", nargs="*", default=[], help="override the attention config: key=value ...")
    parser.add_argument(
        "--inference-mode",
        choices=["full", "sparse"],
        default=None,
        help="full: dense attention; sparse: the run's sparse attention (SSA's sparse stream; MoBA blocks for a dense run)",
    )
    parser.add_argument("--num-blocks", type=_positive, default=None, help="sparse budget: blocks per query (with --inference-mode sparse)")
    parser.add_argument("--block-size", type=_positive, default=None, help="sparse budget: block size")
    parser.add_argument(
        "--rope",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="RoPE for this evaluation: theta=, scaling=none|ntk|linear|yarn, factor=, original_len= (yarn)",
    )
    parser.add_argument("--tag", type=_tag, default=None, help="write RUN/eval/<step>-<tag>.json (default: a name made from the settings)")
    parser.add_argument("--dropped-mass", action="store_true", help="also report the attention mass each layer drops against dense attention")
    processes.add_arguments(parser)
    args = parser.parse_args(argv)
    processes.apply(parser, args)  # before anything initialises JAX
    fibjax_or_exit("launch.eval")

    from fibjax import distributed
    from fibjax.config import ConfigError
    from fibjax.errors import FibjaxError
    from fibjax.eval import runner
    from fibjax.run.workdir import load_run_config

    try:
        distributed.initialize()
        bad = [item for item in args.data if "=" not in item]
        if bad:
            raise ConfigError(f"--data {bad[0]!r}: expected NAME=DIR[:SOURCE]")
        specs = dict(item.split("=", 1) for item in args.data) if args.data else None
        overrides = args.attention
        if args.inference_mode or args.num_blocks or args.block_size:
            cfg = load_run_config(args.workdir)
            overrides = runner.inference_overrides(cfg, args.inference_mode, num_blocks=args.num_blocks, block_size=args.block_size) + overrides
        report, path = runner.evaluate_workdir(
            args.workdir,
            step_number=args.step,
            lengths=args.lengths,
            specs=specs,
            max_tokens=args.max_tokens,
            attention_overrides=overrides,
            dropped_mass=args.dropped_mass,
            rope=args.rope,
            tag=args.tag,
        )
    except runner.ReportNotWritten as e:  # the numbers are right: show them, then say where they could not go
        print(runner.format_table(e.report))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if distributed.is_main():  # one table per job, not per process
        print(runner.format_table(report))
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    survive_closed_pipes()
    sys.exit(main())
