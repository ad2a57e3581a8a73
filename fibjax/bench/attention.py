"""``python -m launch.bench attention``: every attention path, forward and forward+backward.

Paths are registered in ``PATHS`` (name -> builder); each builder gets the case and returns
``f(q, k, v) -> out``. Ratios are computed from timings taken in the same process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from fibjax import attention
from fibjax.bench.timing import Measurement, measure


@dataclass(frozen=True)
class Case:
    seq_len: int
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    window: int = 12
    num_layers: int = 16  # the static/learned alpha is the staggered alpha of the middle layer

    @property
    def alpha(self) -> float:
        return attention.alpha_schedule("staggered", self.num_layers)[self.num_layers // 2]


def _dense(case: Case) -> Callable:
    return attention.dense_attention


def _static(case: Case) -> Callable:
    ds = attention.attended_distances(window=case.window, base="fibonacci", alpha=case.alpha, seq_len=case.seq_len)
    return lambda q, k, v: attention.offset_attention(q, k, v, distances=ds)


def _learned(case: Case) -> Callable:
    # alpha is an argument of the jitted function in training; close over a traced copy here
    return lambda q, k, v: attention.interpolated_attention(q, k, v, window=case.window, base="fibonacci", alpha=jnp.float32(case.alpha))


PATHS: dict[str, Callable[[Case], Callable]] = {"dense": _dense, "static": _static, "learned": _learned}
# (numerator, denominator) pairs printed as ratios
RATIOS: list[tuple[str, str]] = [("static", "dense"), ("learned", "static")]


def inputs(case: Case):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    dt = jnp.dtype(case.dtype)
    return (
        jax.random.normal(kq, (case.batch, case.seq_len, case.heads, case.head_dim), dt),
        jax.random.normal(kk, (case.batch, case.seq_len, case.kv_heads, case.head_dim), dt),
        jax.random.normal(kv, (case.batch, case.seq_len, case.kv_heads, case.head_dim), dt),
    )


def forward_backward(f: Callable) -> Callable:
    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def run(case: Case, paths: list[str], repeats: int) -> dict[tuple[str, str], Measurement]:
    """Measure every path in ``paths`` for one case: {(path, "fwd"|"fwd+bwd"): Measurement}."""
    q, k, v = inputs(case)
    results = {}
    for name in paths:
        f = PATHS[name](case)
        results[(name, "fwd")] = measure(f, q, k, v, repeats=repeats)
        results[(name, "fwd+bwd")] = measure(forward_backward(f), q, k, v, repeats=repeats)
    return results


def table(rows: list[tuple[Case, dict]]) -> str:
    lines = ["| seq | path | fwd ms | fwd+bwd ms | fwd peak MB | fwd+bwd peak MB |", "|---:|---|---:|---:|---:|---:|"]
    for case, res in rows:
        for name in dict.fromkeys(n for n, _ in res):
            f, fb = res[(name, "fwd")], res[(name, "fwd+bwd")]
            lines.append(f"| {case.seq_len} | {name} | {f.ms:.1f} | {fb.ms:.1f} | {f.peak_mb:.0f} | {fb.peak_mb:.0f} |")
    lines += ["", "| seq | ratio | fwd | fwd+bwd |", "|---:|---|---:|---:|"]
    for case, res in rows:
        for num, den in RATIOS:
            if (num, "fwd") in res and (den, "fwd") in res:
                r = [res[(num, m)].ms / res[(den, m)].ms for m in ("fwd", "fwd+bwd")]
                lines.append(f"| {case.seq_len} | {num} / {den} | {r[0]:.3f} | {r[1]:.3f} |")
    return "\n".join(lines)
