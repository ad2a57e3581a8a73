"""Compare evaluated runs: ``python -m launch.report RUN [RUN ...] --out DIR [--reference NAME]
[--step S] [--dataset NAME]``.

RUN is a run directory (its latest ``eval/<step>.json``, or that of ``--step``) or an eval JSON
file. Writes report.md, one CSV per table (matrix, extrap, posloss, alpha) and the plots into
DIR; prints the tables.
"""

from __future__ import annotations

import argparse
import sys

from launch._args import Parser


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories or eval JSON files")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--reference", default=None, help="run whose position-bin NLL the others are compared to")
    parser.add_argument("--step", type=int, default=None, help="use eval/<S>.json (default: the latest of each run)")
    parser.add_argument("--dataset", default=None, help="only this dataset (default: all)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)

    from fibjax.errors import FibjaxError
    from fibjax.eval.report import build_report

    try:
        report = build_report(args.runs, args.out, reference=args.reference, step=args.step, dataset=args.dataset, plots=not args.no_plots)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for message in report.skipped:
        print(f"skipped: {message}")
    for table in report.tables:
        print(table.markdown() + "\n")
    print("written:")
    for path in report.written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
