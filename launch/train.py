"""Train a model: ``python -m launch.train [--config configs/X.py] [--workdir DIR] [key=value ...]``.

With no arguments it trains the tiny default model (configs/tiny.py) on the embedded corpus
and leaves checkpoints and metrics in runs/tiny. Running the same command again resumes.

Several processes (one per host or GPU) run the same command; ``--coordinator host:port
--num-processes N --process-id I`` say how they find each other where no scheduler does (SLURM
and TPU pods are detected; see fibjax/distributed.py and the recipes in launch/).

Exit codes: 0 finished, 2 an error (one ``error:`` line), 3 stopped by SIGTERM/SIGINT before
the last step with a checkpoint saved (run the same command to resume).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# stopped by SIGTERM/SIGINT before the last step, checkpoint saved: not done, so that a job
# array or scheduler requeues it (0 would read as finished)
EXIT_STOPPED = 3
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Python config file with get_config() (default: configs/tiny.py)")
    parser.add_argument("--workdir", default=None, help="run directory (default: runs/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--coordinator", help="host:port of process 0, for multi-process runs without SLURM or a TPU pod (sets FIBJAX_COORDINATOR)")
    parser.add_argument("--num-processes", type=int, help="number of processes in the job (sets FIBJAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, help="this process's index in [0, num-processes) (sets FIBJAX_PROCESS_ID)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.attention.window=8 steps=200")
    args = parser.parse_args(argv)
    flags = {"FIBJAX_COORDINATOR": args.coordinator, "FIBJAX_NUM_PROCESSES": args.num_processes, "FIBJAX_PROCESS_ID": args.process_id}
    given = {k: v for k, v in flags.items() if v is not None}
    if given and len(given) < 3:
        parser.error("--coordinator, --num-processes and --process-id go together")
    os.environ.update({k: str(v) for k, v in given.items()})  # before anything initialises JAX

    import jax

    from fibjax.config import ConfigError, apply_overrides, load_config_file
    from fibjax.data import DataError
    from fibjax.distributed import DistributedError
    from fibjax.train.checkpoint import CheckpointError
    from fibjax.train.loop import NonFiniteLoss, train

    try:
        cfg = apply_overrides(load_config_file(args.config), args.overrides)
        workdir = Path(args.workdir or Path("runs") / cfg.name)
        result = train(cfg, workdir, progress=not args.no_progress)
    except (ConfigError, CheckpointError, NonFiniteLoss, DataError, DistributedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'stopped' if result.preempted else 'finished'} at step {result.final_step}; run directory: {workdir}")
    if result.preempted:
        return EXIT_STOPPED
    # The evaluation is a single-process program (one device, its own checkpoint restore, one
    # report file); inside a multi-process job it would wait for the others in Orbax's barriers.
    if cfg.eval.at_end and not result.preempted and jax.process_count() > 1:
        if jax.process_index() == 0:
            print(f"eval.at_end skipped in a {jax.process_count()}-process job; run: python -m launch.eval --workdir {workdir}")
    elif cfg.eval.at_end and not result.preempted:
        from fibjax.eval import runner
        from fibjax.eval.perplexity import EvalError

        try:
            report, path = runner.evaluate_workdir(workdir)
        except (EvalError, DataError, CheckpointError) as e:  # training succeeded; say why its evaluation could not run
            print(f"error: the end-of-run evaluation failed: {e}\nThe run itself is complete in {workdir}.", file=sys.stderr)
            return 2
        print(runner.format_table(report))
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
