"""Train a model: ``python -m launch.train [--config configs/X.py] [--workdir DIR] [key=value ...]``.

With no arguments it trains the tiny default model (configs/tiny.py) on the embedded corpus
and leaves checkpoints and metrics in runs/tiny. Running the same command again resumes (and
does nothing for a finished run). ``steps=N`` may change on resume, to extend a run: a warning
then says that the learning-rate schedule changes from the saved step on; ``steps`` below the
saved step is refused. ``--resume-step S`` continues from an earlier checkpoint S (e.g. when
the latest is damaged); the later steps are moved to RUN/checkpoints.set_aside/, not deleted.

Several processes (one per host or GPU) run the same command; ``--coordinator host:port
--num-processes N --process-id I`` say how they find each other where no scheduler does (SLURM
and TPU pods are detected; see fibjax/distributed.py and the recipes in launch/).

Exit codes: 0 finished, 2 an error (one ``error:`` line), 3 stopped by SIGTERM/SIGINT before
the last step with a checkpoint saved, or before anything started, or during the end-of-run
evaluation (run the same command to resume).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from launch import processes
from launch._args import Parser, fibjax_or_exit, parse_with_overrides
from launch._streams import survive_closed_pipes

# stopped by SIGTERM/SIGINT before the last step, checkpoint saved: not done, so that a job
# array or scheduler requeues it (0 would read as finished)
EXIT_STOPPED = 3
DEFAULT_CONFIG = "configs/tiny.py"  # found in a clone or in the wheel's copy (fibjax.config.find_config_file)


def main(argv: list[str] | None = None) -> int:
    """The command; SIGTERM and SIGINT are handled from its first line to its last: before the
    loop they stop it before anything starts (exit 3), in the loop at the next step boundary,
    during the end-of-run evaluation at once (exit 3; the report is written whole or not)."""
    fibjax_or_exit("launch.train")
    from fibjax.train.stopping import Preemption  # jax-free: installed before the heavy imports

    stop = Preemption().install()
    try:
        return _main(argv, stop)
    finally:
        stop.uninstall()


def _stopped_before_anything_started() -> int:
    print("stopped by a signal before anything started: nothing was done; run the same command to start", flush=True)
    return EXIT_STOPPED


def _main(argv: list[str] | None, stop) -> int:
    parser = Parser(prog="python -m launch.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Python config file with get_config() (default: configs/tiny.py)")
    parser.add_argument("--workdir", default=None, help="run directory (default: runs/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="S",
        help="continue from checkpoint step S instead of the latest (later steps are moved to RUN/checkpoints.set_aside/)",
    )
    processes.add_arguments(parser)
    parser.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides, anywhere among the flags, e.g. model.attention.window=8 steps=200 data.path=data/mine "
        "(prepared data: docs/guides/your-own-data.md); every key, its type and default: docs/reference/config.md",
    )
    args = parse_with_overrides(parser, argv)
    processes.apply(parser, args)  # before anything initialises JAX

    from fibjax.config import apply_overrides, load_config_file
    from fibjax.errors import FibjaxError

    try:  # the config is pure Python: a typo is reported before JAX's seconds of importing
        cfg = apply_overrides(load_config_file(args.config), args.overrides)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stop.requested:
        return _stopped_before_anything_started()

    import jax

    from fibjax.data.token_files import free_space
    from fibjax.run.integrity import finished_steps
    from fibjax.train.loop import train

    if stop.requested:  # during JAX's import (seconds on a busy machine)
        return _stopped_before_anything_started()
    try:
        workdir = Path(args.workdir or Path("runs") / cfg.name)
        result = train(cfg, workdir, progress=not args.no_progress, resume_step=args.resume_step, preemption=stop)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk under the metrics, the events or the config
        free = f" ({free_space(e.filename)} free there)" if e.filename else ""
        saved = finished_steps(workdir)
        kept = f"checkpoint step(s) {saved} are untouched" if saved else "nothing was trained"
        print(f"error: could not write {e.filename or workdir}: {e.strerror or e}{free}; {kept}: fix that and run the same command", file=sys.stderr)
        return 2
    if result.left_compiling:  # the compiler thread cannot be stopped, and Python's exit would wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)
    eval_file = workdir / "eval" / f"{result.final_step}.json"
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)  # one line per job, not per process
    if result.already_done and (eval_file.exists() or not cfg.eval.at_end):
        where = f"its evaluation table: {eval_file}" if eval_file.exists() else f"evaluate it with: python -m launch.eval --workdir {workdir}"
        say(f"nothing to do: {workdir} is complete at step {result.final_step}; {where}")
        return 0
    if result.already_done:
        say(f"{workdir} is complete at step {result.final_step} but has no {eval_file} yet: evaluating it")
    else:
        say(f"{'stopped' if result.preempted else 'finished'} at step {result.final_step}; run directory: {workdir}")
    if result.preempted:
        return EXIT_STOPPED
    # Every process evaluates: the windows split over the job's devices, as in launch.eval, and
    # process 0 alone writes the report and prints the table.
    if cfg.eval.at_end and not result.preempted:
        from fibjax.eval import runner

        def stopped_evaluating(signum=None, frame=None):
            say(f"stopped by a signal during the end-of-run evaluation: training is complete in {workdir}; run the same command to evaluate it")
            sys.stdout.flush()
            os._exit(EXIT_STOPPED)  # at once: the evaluation cannot stop at a boundary, and its report is written whole or not at all

        if stop.requested:  # after the last step was saved
            stopped_evaluating()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stopped_evaluating)

        try:
            report, path = runner.evaluate_workdir(workdir)
        except runner.ReportNotWritten as e:  # the numbers are right: show them, then say where they could not go
            print(runner.format_table(e.report))
            print(f"error: {e}", file=sys.stderr)
            return 2
        except FibjaxError as e:  # training succeeded; say why its evaluation could not run
            print(f"error: the end-of-run evaluation failed: {e} The run itself is complete in {workdir}.", file=sys.stderr)
            return 2
        say(runner.format_table(report))
        say(f"written: {path}")
    return 0


if __name__ == "__main__":
    survive_closed_pipes()
    sys.exit(main())
