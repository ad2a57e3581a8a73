"""Train a model: ``python -m launch.train [--config configs/X.py] [--workdir DIR] [key=value ...]``.

With no arguments it trains the tiny default model (configs/tiny.py) on the embedded corpus
and leaves checkpoints and metrics in runs/tiny. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Python config file with get_config() (default: configs/tiny.py)")
    parser.add_argument("--workdir", default=None, help="run directory (default: runs/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.attention.window=8 steps=200")
    args = parser.parse_args(argv)

    import jax

    from fibjax.config import ConfigError, apply_overrides, load_config_file
    from fibjax.data import DataError
    from fibjax.train.checkpoint import CheckpointError
    from fibjax.train.loop import NonFiniteLoss, train

    try:
        cfg = apply_overrides(load_config_file(args.config), args.overrides)
        workdir = Path(args.workdir or Path("runs") / cfg.name)
        result = train(cfg, workdir, progress=not args.no_progress)
    except (ConfigError, CheckpointError, NonFiniteLoss, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'stopped' if result.preempted else 'finished'} at step {result.final_step}; run directory: {workdir}")
    if cfg.eval.at_end and not result.preempted and jax.process_index() == 0:
        from fibjax.eval import runner

        report, path = runner.evaluate_workdir(workdir)
        print(runner.format_table(report))
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
