"""Passkey retrieval of a run: ``python -m launch.passkey --workdir RUN [--step S]
[--lengths 256,512,1024] [--depths 0,0.25,0.5,0.75,1 | --distances 16,64,200] [--trials 5]
[--seed 0] [--out DIR] [--attention key=value ...]``.

Writes passkey.json / .csv / .md / .png to DIR (default RUN/eval/passkey-<step>[-<override>])
and prints the Markdown table. ``--distances`` places the needle that many filler tokens before
the question instead of at a depth (retrieval by distance: what a window of W keys cannot
reach). ``--compare DIR ... [--out FILE]`` prints earlier grids side by side, one row a model.
``--write-documents FILE.jsonl [--documents 6000]`` writes the synthetic pass-key
training corpus instead (for ``launch.prepare_data --source passkey=FILE.jsonl``). ``--attention`` evaluates the weights under another attention,
as in ``launch.eval``. On a pod, run the same command on every host, as for ``launch.eval``: the
prompts are split over every device of the job, and process 0 writes the outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch import processes
from launch._args import Parser, comma_list
from launch._streams import survive_closed_pipes


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.passkey", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", help="run directory (config.json, checkpoints/) of the model to test")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--lengths", type=comma_list(int, minimum=1, noun="length"), default=[256, 512, 1024], help="context lengths in tokens")
    parser.add_argument("--depths", type=comma_list(float), default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    parser.add_argument(
        "--distances", type=comma_list(int, minimum=0, noun="distance"), default=None, help="filler tokens between needle and question (instead of --depths)"
    )
    parser.add_argument("--trials", type=int, default=5, help="keys per (length, depth) cell")
    parser.add_argument("--seed", type=int, default=0, help="draws the keys and the filler (the same seed, the same prompts)")
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per forward pass (default: --trials)")
    parser.add_argument("--out", default=None, help="output directory")
    parser.add_argument("--attention", nargs="*", default=[], help="override the attention config: key=value ...")
    parser.add_argument("--write-documents", metavar="FILE", default=None, help="write the synthetic pass-key training corpus (JSON Lines) and exit")
    parser.add_argument("--documents", type=int, default=6000, help="documents for --write-documents")
    parser.add_argument(
        "--compare", nargs="+", metavar="DIR", default=None, help="print the grids of earlier runs' output folders (passkey.json) side by side, and exit"
    )
    processes.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.write_documents:
        return write_documents(args.write_documents, args.documents, args.seed)
    if args.compare:
        return compare(args.compare, args.out)
    if not args.workdir:
        parser.error("--workdir is required (or --write-documents FILE, or --compare DIR ...)")
    processes.apply(parser, args)  # before anything initialises JAX

    from fibjax import distributed
    from fibjax.config import apply_overrides
    from fibjax.errors import FibjaxError
    from fibjax.eval import passkey, runner
    from fibjax.run import load as run_load

    try:
        distributed.initialize()
        run = run_load.load_run(args.workdir, args.step)
        tag = "-".join(a.replace("=", "_") for a in args.attention)
        out = Path(args.out) if args.out else Path(args.workdir) / "eval" / f"passkey-{run.step}{'-' + tag if tag else ''}"
        distributed.on_main(lambda: runner.check_writable(out), "checking where the outputs go")
        tokenizer = run_load.run_tokenizer(run)
        if args.attention:
            params, model_cfg = run_load.with_attention(run, apply_overrides(run.cfg.model.attention, args.attention))
        else:
            params, model_cfg = run.params, run.cfg.model
        # a learned run's alphas compiled as constants (the static path's cost), as launch.eval does
        params, model_cfg = runner.frozen_alphas(params, model_cfg)
        result = passkey.passkey_grid(
            model_cfg,
            params,
            tokenizer,
            args.lengths,
            args.depths,
            args.trials,
            args.seed,
            distances=args.distances,
            batch_size=args.batch_size,
            mesh=runner.eval_mesh(run.cfg),
        )
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = f"{model_cfg.attention.kind} attention" + (f", {' '.join(args.attention)}" if args.attention else "")
    result.update(
        run=run.cfg.name,
        step=run.step,
        train_seq_len=run.cfg.seq_len,
        attention_override=args.attention,
        title=f"Passkey retrieval: {run.cfg.name} step {run.step}, trained at {run.cfg.seq_len} ({how})",
    )
    paths = distributed.on_main(lambda: passkey.write_passkey_outputs(result, out), "writing the passkey outputs")
    if distributed.is_main():  # one table per job, not per process
        print(passkey.format_markdown(result))
        print(f"written: {', '.join(str(p) for p in paths.values())}")
    return 0


def compare(dirs: list[str], out: str | None) -> int:
    """The grids of several output folders side by side (``--compare``), printed, and written to ``out`` if given."""
    import json

    from fibjax.errors import FibjaxError
    from fibjax.eval import passkey

    results = {}
    for d in dirs:
        path = Path(d) / "passkey.json" if Path(d).is_dir() else Path(d)
        if not path.is_file():
            print(f"error: --compare {d}: no passkey.json there (the folder launch.passkey --out wrote)", file=sys.stderr)
            return 2
        if path.parent.name in results:  # the folder's name labels its row: two alike would be one row
            print(f"error: --compare: two folders named {path.parent.name!r}; give folders with distinct names", file=sys.stderr)
            return 2
        try:
            results[path.parent.name] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            print(f"error: --compare {path}: not readable JSON ({e})", file=sys.stderr)
            return 2
    try:
        text = passkey.compare_markdown(results)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if out:
        Path(out).write_text(text + "\n")
        print(f"written: {out}")
    return 0


def write_documents(path: str, count: int, seed: int) -> int:
    """The synthetic pass-key corpus as JSON Lines ({"text": ...} a line), written whole or not at all."""
    import json
    import os

    from fibjax.errors import FibjaxError
    from fibjax.eval import passkey

    try:
        documents = passkey.training_documents(count, seed)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(path)
    if out.parent and not out.parent.is_dir():
        print(f"error: --write-documents {path}: the folder {out.parent} does not exist", file=sys.stderr)
        return 2
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tmp.replace(out)
    print(f"wrote {count:,} pass-key documents to {out} (seed {seed})")
    return 0


if __name__ == "__main__":
    survive_closed_pipes()
    sys.exit(main())
