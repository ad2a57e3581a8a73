"""Benchmarks, side by side in one run: ``python -m launch.bench {attention,kernels,formulations,decode,train} ...``.

Prints a Markdown table of median times, achieved bandwidth and XLA peak memory, then the
ratios measured side by side in this one run. ``python -m launch.bench SUB --help`` shows each
subcommand's options with their defaults. On a 2-core CPU the default ``attention`` run takes
about 4 minutes (dense attention at 16384 tokens is most of it; ``--seq 1024,4096`` takes
about half a minute); progress goes to stderr, one line per path.
"""

from __future__ import annotations

import argparse
import sys

import jax

from launch._args import Parser, comma_list, parse_with_overrides

_ints = comma_list(int, minimum=1)


def main(argv: list[str] | None = None) -> int:
    from fibjax.attention.pallas import BlockSizes
    from fibjax.bench import attention as attn_bench
    from fibjax.bench import decode as decode_bench

    parser = Parser(prog="python -m launch.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    defaults = dict(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p = sub.add_parser("attention", help="attention paths, forward and forward+backward (CPU default: about 4 minutes)", **defaults)
    p.add_argument("--seq", type=_ints, default=[1024, 4096, 16384], help="sequence lengths")
    p.add_argument(
        "--paths",
        default=None,
        help=f"comma list of {[*attn_bench.PATHS, *attn_bench.EXTERNAL]} (default: those fast here; on CPU the *_pallas rows are interpret mode)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=1,
        help="on CPU: run the JAX paths on this many CPU devices, the heads split across them (XLA:CPU runs each device on a thread "
        "of its own, which uses the cores better than its threads within one device); torch keeps its own threads",
    )
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of q, k, v")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")
    p.add_argument(
        "--rounds", type=int, default=1, help="time the paths in turn this many times (median of the rounds' medians): fair ratios on a shared machine"
    )
    p.add_argument("--pallas-blocks", type=_ints, default=None, metavar="BQ,BK[,WARPS,STAGES]", help="the Pallas rows' BlockSizes (default: BlockSizes())")
    p.add_argument(
        "--pallas-variants",
        type=comma_list(str),
        default=None,
        metavar="NAME,...",
        help="time these variants of the block-sparse Pallas kernels side by side, each a row block_sparse_pallas:NAME in place of "
        "block_sparse_pallas (default: the plain row), with its ratio over the plain kernels; names: fibjax/attention/pallas/block_kernels.py VARIANTS",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also time the block-sparse paths among --paths in phases (selection, layout, attention, merge; fibjax/bench/phases.py)",
    )
    p = sub.add_parser("kernels", help="the Pallas kernels against the XLA path on this platform, then their block sizes timed", **defaults)
    p.add_argument("--small", action="store_true", help="two small cases and no sweep: the check itself, in interpret mode on CPU")
    p.add_argument("--sweep-only", action="store_true", help="no comparison: only the block-size sweep")
    p.add_argument("--pallas-blocks", type=_ints, default=None, metavar="BQ,BK[,WARPS,STAGES]", help="BlockSizes of the comparison (default: BlockSizes())")
    p.add_argument("--sweep", default="64,64;128,128;128,128,8;32,64", help="candidate BlockSizes for the sweep, ';'-separated BQ,BK[,WARPS,STAGES]")
    p.add_argument("--sweep-seq", type=int, default=16384, help="sequence length of the sweep (0: no sweep)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="dtype of the sweep")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per sweep candidate")
    p = sub.add_parser("formulations", help="the XLA formulations we chose between (the static path; dense attention)", **defaults)
    p.add_argument("--seq", type=_ints, default=[1024, 4096], help="sequence lengths")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (the median is reported)")
    p = sub.add_parser("decode", help="per-token decoding latency and KV-cache memory, offset / block_sparse / nsa vs dense, against the context", **defaults)
    p.add_argument("--context", type=_ints, default=[1024, 4096, 16384, 65536], help="context lengths")
    p.add_argument("--steps", type=int, default=16, help="tokens timed per context")
    p.add_argument("--kinds", default=",".join(decode_bench.KINDS), help=f"comma list of {list(decode_bench.KINDS)}")
    p.add_argument("--d-model", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="layers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of q, k, v")
    p = sub.add_parser("hf_import", help="peak host memory of launch.import_hf on a random Llama-layout checkpoint, against its size", **defaults)
    p.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size in GiB (bfloat16)")
    p.add_argument("--dir", default=None, help="where to write the model and the run (default: a temporary directory, removed after)")
    p = sub.add_parser("train", help="train-step throughput of configs, side by side (synthetic batches)", **defaults)
    p.add_argument(
        "--configs",
        help="comma-separated config files",
        default="configs/cpu/dense.py,configs/cpu/fib_stagger_w12.py,configs/cpu/fib_learned_w12.py,configs/cpu/pow2_stagger_w12.py",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=1, help="time the configs in turn this many times (fair ratios on a shared machine)")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every config (anywhere among the flags)")
    args = parse_with_overrides(parser, argv)
    if args.what == "train":
        from fibjax.bench import train as train_bench

        # the devices a step uses are each config's mesh (mesh.devices), in the table
        if args.steps < 1 or args.rounds < 1:
            parser.error(f"--steps and --rounds must be >= 1, got {args.steps}, {args.rounds}")
        setup = f"steps={args.steps} rounds={args.rounds} overrides={args.overrides}"
        print(f"backend={jax.default_backend()} available devices={len(jax.devices())} {setup}", flush=True)
        rows = train_bench.measure([c for c in args.configs.split(",") if c], args.overrides, args.steps, args.rounds)
        print(train_bench.table(rows))
        return 0
    if args.what == "hf_import":
        from fibjax.bench import hf_import

        print(hf_import.run(args.size_gb, args.dir))
        return 0
    if args.what == "decode":
        kinds = [k for k in args.kinds.split(",") if k]
        if unknown := sorted(set(kinds) - set(decode_bench.KINDS)):
            parser.error(f"unknown kind(s) {unknown}; known: {list(decode_bench.KINDS)}")
        spec = decode_bench.Spec(d_model=args.d_model, num_layers=args.layers, dtype=args.dtype)
        results, params = decode_bench.run(spec, args.context, args.steps, kinds, progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(f"backend={jax.default_backend()} {spec} batch=1 steps={args.steps} params={params}")
        print(decode_bench.table(results, args.context))
        return 0
    if args.what == "kernels":
        from fibjax.bench import kernels

        blocks = BlockSizes(*args.pallas_blocks) if args.pallas_blocks else BlockSizes()
        candidates = [BlockSizes(*_ints(c)) for c in args.sweep.split(";") if c]
        cases, sweep_seq = (kernels.SMALL_CASES, 0) if args.small else (kernels.CASES, args.sweep_seq)
        if args.sweep_only:
            if args.small or not args.sweep_seq:
                parser.error("--sweep-only needs a sweep: --sweep-seq > 0 and no --small")
            cases = ()
        return kernels.run(cases, blocks, sweep_seq, candidates, args.dtype, args.repeats)
    if args.what == "formulations":
        from fibjax.bench import formulations

        print(f"backend={jax.default_backend()} batch=1 heads=8 kv_heads=8 head_dim=64 float32 repeats={args.repeats}")
        print(formulations.run(args.seq, args.repeats))
        return 0

    if args.cpu_devices < 1 or args.kv_heads % args.cpu_devices:
        parser.error(f"--cpu-devices must be >= 1 and divide --kv-heads {args.kv_heads}, got {args.cpu_devices}")
    if args.phases and args.cpu_devices > 1:
        parser.error("--phases times one device: drop --cpu-devices")
    try:
        mesh = attn_bench.cpu_head_mesh(args.cpu_devices) if args.cpu_devices > 1 else None
    except RuntimeError as e:
        parser.error(str(e))
    paths = [x for x in (args.paths or ",".join(attn_bench.default_paths())).split(",") if x]
    if args.pallas_variants:
        from fibjax.attention.pallas.block_kernels import VARIANTS

        if unknown := sorted(set(args.pallas_variants) - set(VARIANTS)):
            parser.error(f"unknown --pallas-variants {unknown}; known: {list(VARIANTS)}")
        paths = attn_bench.with_variants(paths, args.pallas_variants)
    if unknown := sorted(p for p in set(paths) if not attn_bench.known(p)):
        known = [*attn_bench.PATHS, *attn_bench.EXTERNAL, f"{attn_bench.VARIANT_PATH}:VARIANT"]
        parser.error(f"unknown path(s) {unknown}; known: {known}")
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be >= 1 (got {args.rounds}, {args.repeats})")
    print(
        f"backend={jax.default_backend()} devices={jax.devices()} dtype={args.dtype} batch={args.batch} "
        f"heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} repeats={args.repeats} rounds={args.rounds}",
        flush=True,
    )
    blocks = BlockSizes(*args.pallas_blocks) if args.pallas_blocks else BlockSizes()
    print(f"pallas {blocks}", flush=True)
    rows = []
    for seq in args.seq:
        case = attn_bench.Case(
            seq_len=seq, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, block_sizes=blocks
        )
        progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        rows.append((case, attn_bench.run(case, paths, args.repeats, progress=progress, rounds=args.rounds, mesh=mesh)))
    print(attn_bench.table(rows))
    if args.phases:
        from fibjax.bench import phases

        for case, _ in rows:
            timed = [p for p in paths if phases.timed_here(p)]
            print(f"\nphases, seq {case.seq_len}: {timed or 'no block-sparse path among --paths'}", flush=True)
            if timed:
                print(phases.table(case, phases.run(case, timed, args.repeats, rounds=args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
