"""``python -m launch.bench attention --phases``: where a block-sparse path's time goes.

Each pass of a block-sparse path is cut into the stages its own code runs (the path calls the
same functions, so the phases are the path, not a copy of it), each jitted and timed alone on
the previous stages' outputs:

* forward: **selection** (block scores and top-k, ``block_sparse._chosen_blocks``), **layout**
  (the index metadata and the operands in the attention's layout: for the Pallas path the tile
  map and each tile's gathered query rows), **attention**, **merge** (the outputs back to [B, T,
  H, D]; for the Pallas path the LSE merge of each query's partials);
* backward of the Pallas path: **layout** (delta; q, do, lse and delta gathered into the
  forward's tiles), **attention** (the one backward kernel: dq rows, dk/dv partials), **merge**
  (dq rows summed per query, dk/dv partials per block); of the XLA path: **attention**, its one
  scan (``block_grouped.backward``). Both reuse the forward's layout (the Pallas path its tile map).

Beside them, each pass whole: the forward as the bench times it, the backward as ``jax.vjp``'s
function on the forward's residuals. ``sum / whole`` near 1 says the cut lost nothing; above 1,
the stages' boundaries (intermediates written out and read back) cost that much.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from fibjax.attention import block_grouped
from fibjax.attention import block_sparse as bs
from fibjax.attention.common import finish
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas import block_ops
from fibjax.attention.pallas.block_kernels import VARIANTS, BlockKernelOptions
from fibjax.bench import roofline
from fibjax.bench.attention import Case, builder, inputs, split_variant
from fibjax.bench.timing import Measurement, Timer

PHASE_PATHS = ("block_sparse", "block_sparse_pallas")
WHOLE = "whole"


@dataclass(frozen=True)
class Stage:
    """One timed step: ``fn(*env[reads])`` gives ``env[writes]``; ``flops``: its useful arithmetic."""

    phase: str
    fn: Callable
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    flops: int = 0


def _products(case: Case, passes: int) -> int:
    """``passes`` x 4 D flops a (query head, key) pair: one forward's q.k and p.v."""
    return passes * 4 * case.head_dim * case.batch * case.heads * roofline.pairs(case, "block_sparse")


def _selection(case: Case) -> Stage:
    top = bs.num_earlier_blocks(case.seq_len, case.sparse_block, case.sparse_blocks)
    choose = lambda q, k: bs._chosen_blocks(q, k, None, block=case.sparse_block, top=top, rule="mean_key", chunk=bs.QUERY_CHUNK)  # noqa: E731
    return Stage("selection", choose, ("q", "k"), ("idx",), roofline.selection_flops(case))


def _xla(case: Case) -> tuple[list[Stage], list[Stage]]:
    """``block_sparse``: ``block_sparse.attend_blocks``' stages after the choice."""
    j, tile, chunk = case.sparse_block, block_grouped.TILE, block_grouped.CHUNK
    layout = lambda q, k, v, idx: bs.attend_layout(q, k, v, idx, block_size=j, pair_tile=tile, tile_chunk=chunk)  # noqa: E731
    forward = [
        _selection(case),
        Stage("layout", layout, ("q", "k", "v", "idx"), ("qg", "kp", "vp", "lay")),
        Stage("attention", lambda *a: block_grouped.grouped_attention(*a, j, tile, chunk), ("qg", "kp", "vp", "lay"), ("o", "lse"), _products(case, 1)),
        Stage("merge", lambda o, lse, q: finish(o, lse, q, False), ("o", "lse", "q"), ("out",)),
    ]
    grads = lambda *a: block_grouped.backward(j, tile, chunk, a[:6], a[6:])[:3]  # noqa: E731
    backward = [Stage("attention", grads, ("qg", "kp", "vp", "lay", "o", "lse", "do_g", "dlse_g"), ("dq", "dk", "dv"), _products(case, 2))]
    return forward, backward


def _pallas(case: Case, options: BlockKernelOptions = VARIANTS["default"]) -> tuple[list[Stage], list[Stage]]:
    """``block_sparse_pallas``: ``block_ops``' layout -> kernels -> merge, both passes."""
    spec = block_ops._Spec(case.sparse_block, case.seq_len, case.block_sizes.fit(case.seq_len), be.resolve(None), options)
    tiled = ("tiles", "pos", "qt", "kk", "vk")
    forward = [
        _selection(case),
        Stage("layout", lambda *a: block_ops.fwd_layout(spec, *a), ("q", "k", "v", "idx"), ("tiles", "qh", "kk", "vk", "pos", "qt")),
        Stage("attention", lambda *a: block_ops.fwd_kernels(spec, *a), tiled, ("ok", "lsek"), _products(case, 1)),
        Stage("merge", lambda tiles, o, lse, q: block_ops.fwd_merge(spec, tiles, o, lse, q.dtype), ("tiles", "ok", "lsek", "q"), ("out", "lse_out")),
    ]
    residuals = ("tiles", "qh", "kk", "vk", "pos", "out", "lse_out")
    backward = [
        Stage("layout", lambda *a: block_ops.bwd_layout(spec, a[:7], a[7:]), (*residuals, "do", "dlse"), ("args",)),
        Stage("attention", lambda args: block_ops.bwd_kernels(spec, *args), ("args",), ("parts",), _products(case, 2)),
        Stage("merge", lambda tiles, parts, q, k: block_ops.bwd_merge(spec, tiles, parts, q.dtype, k.dtype), ("tiles", "parts", "q", "k"), ("dq", "dk", "dv")),
    ]
    return forward, backward


STAGES: dict[str, Callable[[Case], tuple[list[Stage], list[Stage]]]] = {"block_sparse": _xla, "block_sparse_pallas": _pallas}


def timed_here(path: str) -> bool:
    """Whether ``path`` (a kernel variant row too: ``block_sparse_pallas:gather``) has phases."""
    return split_variant(path)[0] in PHASE_PATHS


def stages(case: Case, path: str) -> tuple[list[Stage], list[Stage]]:
    base, variant = split_variant(path)
    return _pallas(case, VARIANTS[variant]) if variant else STAGES[base](case)


def cotangents(env: dict) -> dict:
    """The backward's inputs beside the residuals: d out = 1 (the bench's loss is sum(out)), d lse = 0,
    in each path's layout (the XLA path's: ``finish``'s transpose, [B, T', K, G, D] float32)."""
    do = jnp.ones_like(env["q"])
    if "qg" not in env:
        return {"do": do, "dlse": jnp.zeros(do.shape[:3], jnp.float32)}
    b, t, h, d = do.shape
    t_blocks, kh = env["kp"].shape[1:3]
    do_g = jnp.pad(do, ((0, 0), (0, t_blocks - t), (0, 0), (0, 0))).reshape(b, t_blocks, kh, h // kh, d).astype(env["o"].dtype)
    return {"do_g": do_g, "dlse_g": jnp.zeros_like(env["lse"])}


def walk(stages: list[Stage], env: dict, timed: dict[str, Timer] | None = None) -> dict:
    """Run ``stages`` in order, each jitted alone, adding their outputs to ``env``; with ``timed``,
    each stage's program is a ``Timer`` put there under its phase."""
    for s in stages:
        args = [env[r] for r in s.reads]
        if timed is None:
            out = jax.jit(s.fn)(*args)
        else:
            timed[s.phase] = Timer(s.fn, *args)
            out = timed[s.phase].compiled(*args)
        env = {**env, **dict(zip(s.writes, out if len(s.writes) > 1 else (out,)))}
    return env


def start(case: Case) -> dict:
    """The forward's first env: the bench's q, k, v of ``case``."""
    return dict(zip("qkv", inputs(case)))


def timers(case: Case, path: str) -> dict[tuple[str, str], Timer]:
    """{(pass, phase): Timer} for every stage of ``path`` and each pass whole (``WHOLE``)."""
    forward, backward = stages(case, path)
    fwd, bwd = {}, {}
    env = walk(forward, start(case), fwd)
    walk(backward, {**env, **cotangents(env)}, bwd)
    out = {**{("fwd", ph): t for ph, t in fwd.items()}, **{("bwd", ph): t for ph, t in bwd.items()}}
    q, k, v, alpha = env["q"], env["k"], env["v"], jnp.float32(case.alpha)
    f = builder(path)(case)
    _, vjp = jax.jit(lambda q, k, v: jax.vjp(lambda *x: f(*x, alpha), q, k, v))(q, k, v)
    out[("fwd", WHOLE)] = Timer(f, q, k, v, alpha)
    out[("bwd", WHOLE)] = Timer(lambda vjp, do: vjp(do), vjp, jnp.ones_like(q))
    return out


def run(case: Case, paths: list[str], repeats: int, rounds: int = 1) -> dict[tuple[str, str, str], Measurement]:
    """{(path, pass, phase): Measurement} of the block-sparse ``paths``, timed in rotated rounds; a
    path whose stages do not compile here is left out (said on stderr)."""
    every = {}
    for p in paths:
        try:
            every.update({(p, *key): t for key, t in timers(case, p).items()})
        except Exception as e:
            print(f"phases, seq {case.seq_len} {p}: FAILED {type(e).__name__}: {str(e)[:1000]}", file=sys.stderr, flush=True)
    order, times = list(every), {key: [] for key in every}
    for r in range(rounds):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            times[key].append(every[key].times(repeats))
    return {key: every[key].measurement(times[key]) for key in order}


def flops_of(case: Case, path: str) -> dict[tuple[str, str], int]:
    forward, backward = stages(case, path)
    return {**{("fwd", s.phase): s.flops for s in forward}, **{("bwd", s.phase): s.flops for s in backward}}


def table(case: Case, res: dict[tuple[str, str, str], Measurement]) -> str:
    """One row per phase: its time, its share of its pass's whole and its TFLOP/s; then each pass's
    sum of phases over the whole."""
    lines = ["| seq | path | pass | phase | ms | % of whole | TFLOP/s |", "|---:|---|---|---|---:|---:|---:|"]
    for path in dict.fromkeys(p for p, _, _ in res):
        flops = flops_of(case, path)
        for pass_ in ("fwd", "bwd"):
            whole = res[(path, pass_, WHOLE)].ms
            phases = [(ph, m) for (p, ps, ph), m in res.items() if p == path and ps == pass_ and ph != WHOLE]
            for phase, m in phases:
                tf = f"{flops[(pass_, phase)] / (m.ms * 1e9):.3g}" if flops[(pass_, phase)] else "-"
                lines.append(f"| {case.seq_len} | {path} | {pass_} | {phase} | {m.ms:.3f} | {100 * m.ms / whole:.0f} | {tf} |")
            total = sum(m.ms for _, m in phases)
            lines.append(f"| {case.seq_len} | {path} | {pass_} | sum / whole | {total:.3f} / {whole:.3f} | {100 * total / whole:.0f} | |")
    return "\n".join(lines)


def sum_over_whole(res: dict[tuple[str, str, str], Measurement], path: str, pass_: str) -> float:
    phases = sum(m.ms for (p, ps, ph), m in res.items() if p == path and ps == pass_ and ph != WHOLE)
    return phases / res[(path, pass_, WHOLE)].ms
