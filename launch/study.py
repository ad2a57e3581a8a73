"""Run a study (many runs trained, evaluated and reported; resumable): ``python -m launch.study STUDY.py [--only A,B] [--stage N] [--status] [--retrain]``.

Trains every run of the study in order (each as ``python -m launch.train``), evaluates it
(``python -m launch.eval``), and rewrites the study's report after each run. Run it again and
it skips finished runs and resumes unfinished ones from their checkpoints. Long studies: run it
in the background under ``nice``; ``--status`` says what is done, running and left, with an ETA.
Runs finished on another machine are restored from the study's committed ``study.json``
(curves and evaluations, no checkpoints); ``--retrain`` trains such a run again here.
SIGTERM/SIGINT are passed to the training child, which saves; the study then exits with 3.
"""

from __future__ import annotations

import argparse
import sys

from launch._args import Parser


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="a study file with get_study(), e.g. configs/study/cpu.py")
    parser.add_argument("--only", default=None, help="comma-separated run names (default: every run)")
    parser.add_argument("--stage", type=int, default=None, help="only the runs of this stage (default: every stage, in file order)")
    parser.add_argument("--status", action="store_true", help="print done / running / to do with tokens and ETA, and exit (writes nothing)")
    parser.add_argument("--retrain", action="store_true", help="train again the selected runs that were restored from study.json (no checkpoints here)")
    parser.add_argument("--report", action="store_true", help="only (re)write the report of the finished runs")
    args = parser.parse_args(argv)

    from fibjax.config import ConfigError
    from fibjax.errors import FibjaxError
    from fibjax.study import StudyStopped, format_status, load_study, read_record, restore_recorded, run_one, run_status, set_aside_restored, write_results

    try:
        study = load_study(args.study)
        runs = study.select(args.only.split(",") if args.only else None, args.stage)
        if not runs:
            raise ConfigError(f"no run of {args.study} matches --only {args.only} --stage {args.stage}")
        if args.status:  # reads only: a run recorded as done elsewhere is shown so, not rebuilt
            record = read_record(study, say=lambda _msg: None)
            print(format_status(study, [run_status(study, r, record) for r in runs]))
            return 0
        restore_recorded(study)
        if args.retrain:
            for run in runs:
                set_aside_restored(study, run)
        if not args.report:
            for run in runs:
                if run_status(study, run).state == "done":
                    print(f"[{run.name}] done")
                    continue
                run_one(study, run)
                write_results(study)
        write_results(study)
    except StudyStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
