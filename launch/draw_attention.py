"""Draw what each layer attends: ``python -m launch.draw_attention [--out FILE]``.

Paper A's schedules side by side at the CPU study's shape (8 layers, window 8, 256 tokens):
fixed, staggered and coprime Fibonacci rungs, staggered powers of two, and a learned model's
alphas after training, read from a study's alpha.csv (default: the CPU study's,
results/study/alpha.csv, run fib_learned_w8, when the working directory is a clone; elsewhere,
an installed wheel's user for instance, the learned panel is left out and the command says so).
The figure in the docs is this command's output, run in a clone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch._args import Parser

STUDY_ALPHAS = "results/study/alpha.csv"  # the CPU study's trained alphas, in a clone


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.draw_attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/images/attended_distances.png", help="the PNG to write (default: the docs' copy)")
    parser.add_argument("--alpha-csv", default=None, help=f"a study's alpha.csv for the learned panel ('' leaves it out; default: {STUDY_ALPHAS} if present)")
    parser.add_argument("--learned-run", default="fib_learned_w8", help="the run in --alpha-csv whose trained alphas to draw")
    parser.add_argument("--layers", type=int, default=8, help="number of layers (the learned run's, when drawn)")
    parser.add_argument("--window", type=int, default=8, help="the dense window W")
    parser.add_argument("--seq-len", type=int, default=256, help="the length the distances are drawn at (the training length)")
    args = parser.parse_args(argv)

    from fibjax.eval import attended

    if args.alpha_csv is None:
        args.alpha_csv = STUDY_ALPHAS if Path(STUDY_ALPHAS).is_file() else ""
        if not args.alpha_csv:
            print(f"note: no {STUDY_ALPHAS} here (a clone has it), so the learned panel is left out")
    try:
        learned = attended.learned_alphas(args.alpha_csv, args.learned_run) if args.alpha_csv else None
    except (OSError, ValueError) as e:
        print(f"error: {e} (--alpha-csv '' draws the static schedules only)", file=sys.stderr)
        return 2
    if learned is not None and len(learned) != args.layers:
        parser.error(f"{args.learned_run} has {len(learned)} layers, not --layers {args.layers}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    attended.plot_attended_distances(attended.paper_panels(args.layers, learned), Path(args.out), window=args.window, seq_len=args.seq_len)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
