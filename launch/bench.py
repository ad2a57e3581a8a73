"""Benchmarks: ``python -m launch.bench {attention,formulations,decode,train} ...``.

Prints a Markdown table of median times, achieved bandwidth and XLA peak memory, then the
ratios measured side by side in this one run.
"""

from __future__ import annotations

import argparse
import sys

import jax


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    from fibjax.attention.pallas import BlockSizes
    from fibjax.bench import attention as attn_bench

    parser = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("attention", help="attention paths, forward and forward+backward")
    p.add_argument("--seq", type=_ints, default=[1024, 4096, 16384])
    p.add_argument("--paths", default=",".join(attn_bench.default_paths()),
                   help=f"comma list of {list(attn_bench.PATHS)} (default: those fast here; on CPU the *_pallas rows are interpret mode)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pallas-blocks", type=_ints, default=None, metavar="BQ,BK[,WARPS,STAGES]",
                   help="the Pallas rows' BlockSizes (default: BlockSizes())")
    p = sub.add_parser("formulations", help="the XLA formulations of the static path we chose between")
    p.add_argument("--seq", type=_ints, default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("decode", help="per-token decoding latency and KV-cache memory, sparse vs dense, against the context")
    p.add_argument("--context", type=_ints, default=[1024, 4096, 16384, 65536])
    p.add_argument("--steps", type=int, default=16, help="tokens timed per context")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p = sub.add_parser("train", help="train-step throughput of configs, side by side (synthetic batches)")
    p.add_argument("--configs", default="configs/cpu/dense.py,configs/cpu/fib_stagger_w12.py,configs/cpu/fib_learned_w12.py,configs/cpu/pow2_stagger_w12.py")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every config")
    args = parser.parse_args(argv)
    if args.what == "train":
        from fibjax.bench import train as train_bench

        print(f"backend={jax.default_backend()} devices={len(jax.devices())} steps={args.steps} overrides={args.overrides}", flush=True)
        rows = [train_bench.measure_config(c, args.overrides, args.steps) for c in args.configs.split(",") if c]
        print(train_bench.table(rows))
        return 0
    if args.what == "decode":
        from fibjax.bench import decode as decode_bench

        spec = decode_bench.Spec(d_model=args.d_model, num_layers=args.layers, dtype=args.dtype)
        results, params = decode_bench.run(spec, args.context, args.steps, progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"backend={jax.default_backend()} {spec} batch=1 steps={args.steps} params={params}")
        print(decode_bench.table(results, args.context))
        return 0
    if args.what == "formulations":
        from fibjax.bench import formulations

        print(f"backend={jax.default_backend()} batch=1 heads=8 kv_heads=8 head_dim=64 float32 repeats={args.repeats}")
        print(formulations.run(args.seq, args.repeats))
        return 0

    paths = [x for x in args.paths.split(",") if x]
    unknown = sorted(set(paths) - set(attn_bench.PATHS))
    if unknown:
        parser.error(f"unknown path(s) {unknown}; known: {list(attn_bench.PATHS)}")
    print(f"backend={jax.default_backend()} devices={jax.devices()} dtype={args.dtype} batch={args.batch} "
          f"heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} repeats={args.repeats}", flush=True)
    blocks = BlockSizes(*args.pallas_blocks) if args.pallas_blocks else BlockSizes()
    print(f"pallas {blocks}", flush=True)
    rows = []
    for seq in args.seq:
        case = attn_bench.Case(seq_len=seq, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                               block_sizes=blocks)
        rows.append((case, attn_bench.run(case, paths, args.repeats)))
        print(f"seq {seq} done", file=sys.stderr, flush=True)
    print(attn_bench.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
