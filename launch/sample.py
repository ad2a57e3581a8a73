"""Sample text from a trained run: ``python -m launch.sample --workdir RUN [--step S]
(--prompt TEXT | --prompt-file F) [--max-new-tokens N] [--temperature T] [--top-k K]
[--top-p P] [--seed S] [--greedy] [--max-context N] [--ignore-eos]``.

Prints the prompt, then the continuation as it is generated (cached decoding: fibjax.decode),
and a one-line summary on stderr. Generation stops at the end-of-document token unless
--ignore-eos. A model with dense layers takes at most its training length in all (prompt +
new tokens) unless --max-context says otherwise; an offset model has no limit but memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from launch._args import Parser


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt-file", help="a UTF-8 file whose text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate after the prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this probability mass (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed, the same text)")
    parser.add_argument("--greedy", action="store_true", help="always the most likely token (same as --temperature 0)")
    parser.add_argument(
        "--max-context", type=int, default=None, help="most tokens in all (prompt + new); default: the training length for dense models, none for offset models"
    )
    parser.add_argument(
        "--inference-mode",
        choices=["full", "sparse"],
        default=None,
        help="full: dense attention; sparse: the run's sparse attention (SSA's sparse stream; MoBA blocks for a dense run)",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="sparse budget: blocks per query (with --inference-mode sparse)")
    parser.add_argument("--block-size", type=int, default=None, help="sparse budget: block size")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-document token")
    args = parser.parse_args(argv)

    from fibjax.decode import Decoder, Sampler, TextStreamer
    from fibjax.decode import run as run_lib
    from fibjax.errors import FibjaxError

    try:
        text = args.prompt if args.prompt is not None else _read(args.prompt_file)
        run_lib.check_prompt_text(text)  # before loading anything
        sampler = Sampler(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p)
        overrides = None
        if args.inference_mode or args.num_blocks or args.block_size:
            from fibjax.eval.runner import inference_overrides
            from fibjax.run.workdir import load_run_config

            overrides = inference_overrides(load_run_config(args.workdir), args.inference_mode, num_blocks=args.num_blocks, block_size=args.block_size)
        run = run_lib.load(args.workdir, args.step, overrides)
        limit = run_lib.context_limit(run.cfg, args.max_context)
        ids = run_lib.encode_prompt(run.tokenizer, text, args.max_new_tokens, limit)
        decoder = Decoder(run.model, max_len=len(ids) + args.max_new_tokens)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    sampler = dataclasses.replace(sampler, vocab_size=run.tokenizer.vocab_size)  # never an id the tokenizer lacks
    print(text, end="", flush=True)
    streamer, count, start = TextStreamer(run.tokenizer, ids), 0, time.perf_counter()
    stop = None if args.ignore_eos else run.tokenizer.eos_id
    for tokens_B in decoder.generate([ids], args.max_new_tokens, sampler=sampler, seed=args.seed, stop_token=stop):
        count += 1
        if int(tokens_B[0]) != stop:
            print(streamer.push(int(tokens_B[0])), end="", flush=True)
    print(streamer.finish(), flush=True)
    seconds = time.perf_counter() - start
    print(
        f"[{run.cfg.name} step {run.step}: {len(ids)} prompt tokens, {count} new in {seconds:.2f} s "
        f"(including compilation), cache rows per layer {[p.rows for p in decoder.plans]}]",
        file=sys.stderr,
    )
    return 0


def _read(path: str) -> str:
    from fibjax.decode.run import SampleError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SampleError(f"cannot read --prompt-file {path!r}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
