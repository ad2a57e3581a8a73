"""Prepare training data: ``python -m launch.prepare_data --out DIR --source NAME=SPEC ...``.

Trains a SentencePiece tokenizer (or uses --tokenizer) and writes it to DIR (tokenizer.model, or
tokenizer.json for a Hugging Face one), DIR/<name>/{train,val}.bin and DIR/meta.json. Running it
again with the same inputs does nothing. SPEC: files, folders or globs (comma-separated; .txt,
.jsonl, .jsonl.gz, .parquet), ``hf:DATASET[:CONFIG][@SPLIT]`` (needs `datasets` and network), or
``embedded:python-docs``. A repeated NAME adds inputs to it.

Your own text (any folder of .txt/.jsonl/.parquet files; 10% of documents held out by hash):

  python -m launch.prepare_data --out data/mine --vocab-size 8192 --val-fraction 0.1 --source mine=path/to/folder

Your text for a Hugging Face model (its tokenizer.json or tokenizer.model, and the BOS/EOS it
uses, read from its directory; each document is written as [BOS] tokens EOS as the model saw them):

  python -m launch.prepare_data --out data/mine-llama --tokenizer path/to/Llama-3.2-1B --source mine=path/to/folder

Hugging Face datasets (the hf extra: pip install "fibjax[hf]", or pip install -e ".[hf]" in a
clone; network; docs/guides/your-own-data.md
"5. The papers' and the CPU study's data" has the CPU and paper mixtures):

  python -m launch.prepare_data --out data/web --vocab-size 8192 --max-tokens 8000000 \\
    --source fineweb=hf:HuggingFaceFW/fineweb:sample-10BT

The project's shared corpora (developers' machines only: a user's clone has no ../shared):

  python -m launch.prepare_data --out data/mix --vocab-size 32768 \\
    --source fineweb='../shared/data/fineweb/fineweb_train_*.jsonl.gz' \\
    --val fineweb=../shared/data/fineweb/fineweb_val.jsonl.gz \\
    --val fineweb_edu=../shared/data/fineweb/fineweb_edu_val.jsonl.gz \\
    --source wikipedia='../shared/data/wikipedia/enwiki_train_*.jsonl.gz' \\
    --val wikipedia=../shared/data/wikipedia/enwiki_val.jsonl.gz
"""

from __future__ import annotations

import argparse
import sys

from launch._args import Parser


def _named(pairs: list[str]) -> dict[str, str]:
    from fibjax.data.sources import parse_named

    out: dict[str, str] = {}
    for pair in pairs:
        name, spec = parse_named(pair)
        out[name] = f"{out[name]},{spec}" if name in out else spec
    return out


def main(argv: list[str] | None = None) -> int:
    from fibjax.data import prepare
    from fibjax.data.prepare import DEFAULT_TOKENIZER_CHARS, DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE
    from fibjax.errors import FibjaxError

    parser = Parser(prog="python -m launch.prepare_data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=SPEC", help="a training source (repeatable)")
    parser.add_argument(
        "--val",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="validation inputs of a source, or a validation-only source; without it a source holds out --val-fraction",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help=f"pieces of the tokenizer to train (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="use this tokenizer instead of training one: a SentencePiece .model, a tokenizer.json, or a Hugging Face model directory",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="stop each split of each source after this many tokens")
    parser.add_argument("--max-docs", type=int, default=None, help="read at most this many documents from each source and val input")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="documents held out when a source has no --val")
    parser.add_argument("--tokenizer-chars", type=int, default=DEFAULT_TOKENIZER_CHARS, help="characters of text the tokenizer trains on")
    parser.add_argument("--overwrite", action="store_true", help="replace data prepared from other inputs in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.out,
            _named(args.source),
            _named(args.val),
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            max_tokens=args.max_tokens,
            max_docs=args.max_docs,
            val_fraction=args.val_fraction,
            tokenizer_chars=args.tokenizer_chars,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = meta["tokenizer"]
    start = f"BOS {tok['bos_id']} + " if tok["add_bos"] else ""
    print(f"{args.out}: vocab {tok['vocab_size']} ({meta['dtype']}), tokenizer sha256 {tok['sha256'][:12]}, documents {start}tokens + EOS {tok['eos_id']}")
    for name, source in meta["sources"].items():
        counts = ", ".join(f"{split} {s['tokens']:,} tokens / {s['documents']:,} docs" for split, s in source.items())
        print(f"  {name}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
