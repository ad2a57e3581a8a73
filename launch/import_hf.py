"""Import a Hugging Face Llama-family model: ``python -m launch.import_hf MODEL_DIR --workdir runs/NAME
[--seq-len N] [--dtype float32|bfloat16]``.

MODEL_DIR is a local directory (no download) holding config.json, model.safetensors (or shards
named by model.safetensors.index.json) and tokenizer.json or tokenizer.model: Llama 2 and 3
(rope_scaling llama3), Mistral (without a sliding window), Qwen2, and models of the same layout
(TinyLlama, SmolLM). It becomes a fibjax run of a dense model that every command reads as it is:

  python -m launch.eval --workdir runs/NAME --data NAME=DIR --lengths 2048,8192
  python -m launch.sample --workdir runs/NAME --prompt "..."
  python -m launch.train --config CONFIG init_from=runs/NAME model.attention.kind=offset ...

Evaluation and training text must be prepared with the model's own tokenizer:
``python -m launch.prepare_data --out DIR --tokenizer MODEL_DIR --source NAME=FILES``.
An architecture fibjax cannot compute exactly, a config.json field missing or of the wrong type,
a safetensors file that is truncated or not laid out as the format says, a tensor whose shape or
dtype disagrees with config.json, NaN or infinite weights, a tied model that stores another
lm_head, a missing tokenizer or a non-empty --workdir is one error line (exit 2), and nothing is
written: the run is written under a temporary name beside --workdir and renamed into place when
complete, so SIGTERM or Ctrl-C (exit 3) leaves no run either. Nothing from MODEL_DIR is executed
(no remote code, no pickles). Guide: docs/guides/hugging-face.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from launch._args import Parser


class Stopped(BaseException):
    """SIGTERM or SIGINT during the import: raised where Python was, so that the import removes
    its temporary directory on the way out (a BaseException: no ``except Exception`` keeps it)."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.import_hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="a local Hugging Face model directory")
    parser.add_argument("--workdir", required=True, help="the new run directory (must not exist, or be empty)")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="the run's training length: evaluation lengths are its multiples (default: max_position_embeddings)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    if args.seq_len is not None and args.seq_len < 8:
        parser.error(f"--seq-len must be >= 8, got {args.seq_len}")

    from fibjax.errors import FibjaxError
    from fibjax.hf import import_model
    from fibjax.hf.config import read_json
    from fibjax.kinds import registry

    start = time.perf_counter()
    handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cfg = import_model(args.model_dir, args.workdir, seq_len=args.seq_len, dtype=args.dtype)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"stopped by {e} before the import finished: nothing was written to {args.workdir}; run the same command to import it", file=sys.stderr)
        return 3
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    m = cfg.model
    dtypes = f"{m.param_dtype} parameters, {m.dtype} compute" if m.dtype != m.param_dtype else f"{m.dtype} parameters and compute"
    recorded = "fibjax_attention" in read_json(Path(args.model_dir) / "config.json")
    field = "fibjax_attention" if recorded else "sliding_window"
    attention = "" if m.attention.kind == registry.FULL else f", {m.attention.kind} attention ({field} in config.json)"
    print(
        f"imported {args.model_dir} into {args.workdir} in {time.perf_counter() - start:.1f} s: {m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads} heads / {m.num_kv_heads} KV, vocab {m.vocab_size}, {dtypes}, RoPE theta {m.rope_theta:g}"
        + (f" ({m.rope_scaling} x{m.rope_factor:g})" if m.rope_scaling != "none" else "")
        + f"{attention}; training length {cfg.seq_len}"
    )
    prepare = f"python -m launch.prepare_data --out data/NAME --tokenizer {args.model_dir} --source NAME=FILES"
    print(f"next: {prepare}, then python -m launch.eval --workdir {args.workdir} --data NAME=data/NAME")
    return 0


if __name__ == "__main__":
    sys.exit(main())
