"""The retrieval probe (paper A's test of whether learned dilation moves):
``python -m launch.probe [--smoke] [--out DIR] [--experiments band,marked,coverage]
[--conditions ...] [--depths 2,4] [--steps 800] [--plan] [--report-only]``.

Trains one small model per (experiment, condition, depth) with the library's model and train
step on synthetic tokens, writes ``DIR/<experiment>/<condition>_L<depth>.json`` per cell
(existing cells are skipped: rerun the same command to resume), then the report: report.md,
CSVs and PNGs in DIR. ``--smoke`` runs one small dense cell (under a minute) into
``runs/probe-smoke``. ``--plan`` prints the distances the grid would use and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch._args import Parser, comma_list


def _list(kind):
    parse = comma_list(kind)
    return lambda text: tuple(parse(text))


def main(argv: list[str] | None = None) -> int:
    from fibjax.probe import grid

    d = grid.GridOptions()
    parser = Parser(prog="python -m launch.probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="output directory (default results/probe; runs/probe-smoke with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="one small dense cell, then its report")
    parser.add_argument("--experiments", type=_list(str), default=d.experiments, help=f"any of {','.join(grid.EXPERIMENTS)}")
    parser.add_argument("--conditions", type=_list(str), default=d.conditions, help=f"attention conditions, any of {','.join(d.conditions)}")
    parser.add_argument("--depths", type=_list(int), default=d.depths, help=f"model depths in layers, one cell each (default: {','.join(map(str, d.depths))})")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="sequence length T of the synthetic tasks (default: %(default)s)")
    parser.add_argument("--window", type=int, default=d.window, help="dense local window W of the sparse conditions (default: %(default)s)")
    parser.add_argument("--band-width", type=int, default=d.band_width, help="width in distances of each training band (default: %(default)s)")
    parser.add_argument("--band-centres", type=_list(int), default=(), help="band centres (default: computed, see --plan)")
    parser.add_argument("--marked-distances", type=_list(int), default=(), help="d1,d2 of the marked copy (default: computed)")
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps per cell (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per training step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds the model and the task draws (default: %(default)s)")
    parser.add_argument("--soft-width", type=float, default=d.soft_width, help="initial bump width of the soft experiment")
    parser.add_argument(
        "--alpha-lr-multiplier",
        type=float,
        default=d.alpha_lr_multiplier,
        help="lr multiplier of the learned alphas (not 1: results go to <experiment>_alr<m>)",
    )
    parser.add_argument("--plan", action="store_true", help="print the distances and cells, run nothing")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the cells on disk")
    parser.add_argument("--no-plots", action="store_true", help="write the report's tables, not its PNGs")
    args = parser.parse_args(argv)

    from fibjax.errors import FibjaxError
    from fibjax.probe import report
    from fibjax.probe.cell import run_cell

    try:
        opts = grid.GridOptions(
            experiments=args.experiments,
            conditions=args.conditions,
            depths=args.depths,
            seq_len=args.seq_len,
            window=args.window,
            band_width=args.band_width,
            band_centres=args.band_centres,
            marked_distances=args.marked_distances,
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            seed=args.seed,
            soft_width=args.soft_width,
            alpha_lr_multiplier=args.alpha_lr_multiplier,
        )
        if args.smoke:
            out = Path(args.out or "runs/probe-smoke")
            spec = grid.smoke_spec(args.seed)
            record = run_cell(spec)
            grid.write_json(grid.cell_path(out, spec), record)
            acc = record["accuracy"]
            print(
                f"smoke: {spec.name} at distances {acc['distances']}: accuracy {[round(a, 3) for a in acc['accuracy']]} "
                f"(chance {acc['chance']:.2f}) in {record['seconds']['total']:.0f} s"
            )
        else:
            out = Path(args.out or "results/probe")
            print(grid.plan(opts))
            if args.plan:
                for e in opts.experiments:
                    print(f"{e}: {', '.join(s.name for s in grid.cell_specs(opts, e))}")
                return 0
            if not args.report_only:
                grid.run_grid(opts, out)
        tables, written, _ = report.build_report(out, make_plots=not args.no_plots)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in tables:
        print(t.markdown() + "\n")
    print("written:\n  " + "\n  ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
