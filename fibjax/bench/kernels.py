"""``python -m launch.bench kernels``: the Pallas kernels against the XLA path on this machine's
platform (Triton on GPU, Mosaic on TPU, interpret mode on CPU), then their block sizes timed.

This is the first step of the hardware checks (``launch/gpu_check.sh``, ``launch/tpu_check.sh``):
a kernel that compiles but disagrees with the XLA path must not become a platform's default
(``PALLAS_BY_DEFAULT`` in ``fibjax/attention/pallas/backend.py``). Each case prints the largest
|pallas - xla| of the output, the lse and the gradients to q, k, v and alpha (block-sparse: no
alpha, its gradient 0 on both sides), and PASS or FAIL
against the tolerances below (those of the test suite's oracle comparisons; alpha's gradient, a
sum over every query, is compared relative to its size).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention import attended_distances
from fibjax.attention.block_sparse import block_sparse_attention_xla
from fibjax.attention.offset_xla import interpolated_attention_xla, offset_attention_xla
from fibjax.attention.pallas import BlockSizes, interpolated_attention_pallas, offset_attention_pallas
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from fibjax.bench import attention as attn_bench
from fibjax.bench.timing import measure

# (outputs, gradients) absolute tolerances per dtype: tests/oracle.py's TOL and GRAD_TOL
TOLERANCE = {"float32": (2e-5, 1e-4), "bfloat16": (3e-2, 8e-2)}
WINDOW, ALPHA = 12, 0.93


@dataclass(frozen=True)
class KernelCase:
    seq_len: int
    heads: int
    kv_heads: int
    dtype: str
    head_dim: int = 64
    batch: int = 2


# a ragged length in fp32, and grouped queries over many blocks in bf16 (two cases: compiling each
# case's kernels takes ~55 s a path on an H200, BUILD_NOTES "GPU check")
CASES = (KernelCase(1000, 8, 8, "float32"), KernelCase(4096, 8, 2, "bfloat16"))
SMALL_CASES = (KernelCase(200, 4, 4, "float32", head_dim=16, batch=1), KernelCase(200, 4, 2, "bfloat16", head_dim=16, batch=1))


def _pairs(case: KernelCase, blocks: BlockSizes) -> dict:
    ds = attended_distances(window=WINDOW, base="fibonacci", alpha=ALPHA, seq_len=case.seq_len)
    learned = dict(window=WINDOW, base="fibonacci", return_lse=True)
    # the bench's block-sparse row: 16 blocks of 16 (the choice is the same XLA code in both)
    sparse = dict(block_size=attn_bench.Case.sparse_block, num_blocks=attn_bench.Case.sparse_blocks, return_lse=True)
    return {
        "static": (
            lambda q, k, v, a: offset_attention_pallas(q, k, v, distances=ds, return_lse=True, block_sizes=blocks),
            lambda q, k, v, a: offset_attention_xla(q, k, v, distances=ds, return_lse=True),
        ),
        "learned": (
            lambda q, k, v, a: interpolated_attention_pallas(q, k, v, alpha=a, block_sizes=blocks, **learned),
            lambda q, k, v, a: interpolated_attention_xla(q, k, v, alpha=a, **learned),
        ),
        "block_sparse": (
            lambda q, k, v, a: block_sparse_attention_pallas(q, k, v, block_sizes=blocks, **sparse),
            lambda q, k, v, a: block_sparse_attention_xla(q, k, v, **sparse),
        ),
    }


def _with_grads(f, args, w):
    def loss(q, k, v, a):
        out, lse = f(q, k, v, a)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.jit(lambda *x: (f(*x), jax.grad(loss, (0, 1, 2, 3))(*x)))(*args)


def compare(case: KernelCase, blocks: BlockSizes) -> list[str]:
    """One line per path: the errors, PASS/FAIL, or FAILED with the exception (the rest still runs)."""
    ks = jax.random.split(jax.random.PRNGKey(case.seq_len), 4)
    dtype = jnp.dtype(case.dtype)
    shapes = (case.heads, case.kv_heads, case.kv_heads)
    q, k, v = (jax.random.normal(kk, (case.batch, case.seq_len, n, case.head_dim), jnp.float32).astype(dtype) for kk, n in zip(ks, shapes))
    args, w = (q, k, v, jnp.float32(ALPHA)), jax.random.normal(ks[3], q.shape)
    out_tol, grad_tol = TOLERANCE[case.dtype]
    lines = []
    for name, (pallas, xla) in _pairs(case, blocks).items():
        where = f"T={case.seq_len} H={case.heads} K={case.kv_heads} D={case.head_dim} {case.dtype} {name}"
        try:
            # fp32 at full precision: an H200's XLA matmuls default to TF32 (~5e-4 relative), which
            # is what the first GPU run's fp32 "FAIL" measured (BUILD_NOTES, "GPU check")
            with jax.default_matmul_precision("highest" if case.dtype == "float32" else None):
                ((out, lse), grads), ((ref_out, ref_lse), ref_grads) = _with_grads(pallas, args, w), _with_grads(xla, args, w)
        except Exception as e:  # a kernel that does not compile here: say so, keep checking the others
            lines.append(f"{where}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            continue

        def err(x, y):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            finite = np.isfinite(y)
            return float(np.max(np.abs(np.where(finite, x - y, 0.0)))) if np.array_equal(finite, np.isfinite(x)) else float("inf")

        errors = [err(out, ref_out), err(lse, ref_lse), *(err(g, r) for g, r in zip(grads[:3], ref_grads[:3]))]
        dalpha = abs(float(grads[3]) - float(ref_grads[3])) / max(1.0, abs(float(ref_grads[3])))
        ok = errors[0] <= out_tol and errors[1] <= out_tol and max(errors[2:]) <= grad_tol and dalpha <= grad_tol
        lines.append(
            f"{where}: max |pallas - xla| out {errors[0]:.2e} lse {errors[1]:.2e} dq {errors[2]:.2e} dk {errors[3]:.2e} dv {errors[4]:.2e};"
            f" dalpha relative {dalpha:.2e} (xla {float(ref_grads[3]):.4g}) {'PASS' if ok else 'FAIL'}"
        )
    return lines


def sweep(seq_len: int, candidates: list[BlockSizes], dtype: str, repeats: int) -> BlockSizes | None:
    """Time static + learned Pallas fwd+bwd at ``seq_len`` for each candidate, each also over the
    first candidate that ran (the same process, one after the other); the fastest that ran."""
    best = first = None
    for blocks in candidates:
        case = attn_bench.Case(seq_len=seq_len, kv_heads=8, dtype=dtype, block_sizes=blocks)
        q, k, v = attn_bench.inputs(case)
        try:
            ms = [
                measure(attn_bench.forward_backward(attn_bench.PATHS[p](case)), q, k, v, jnp.float32(case.alpha), repeats=repeats).ms
                for p in ("static_pallas", "learned_pallas")
            ]
        except Exception as e:
            print(f"{blocks}: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
            continue
        first = first or ms
        print(f"{blocks}: fwd+bwd ms static {ms[0]:.3f} learned {ms[1]:.3f}; / first {ms[0] / first[0]:.3f} {ms[1] / first[1]:.3f}", flush=True)
        if best is None or sum(ms) < best[0]:
            best = (sum(ms), blocks)
    return None if best is None else best[1]


def run(cases, blocks: BlockSizes, sweep_seq: int | None, candidates: list[BlockSizes], dtype: str, repeats: int) -> int:
    """Print the comparison and the sweep; the last line is the chosen blocks as BQ,BK,WARPS,STAGES
    (for ``launch.bench attention --pallas-blocks``). Exit status 1 if any case failed."""
    print(f"backend={jax.default_backend()} devices={jax.devices()} pallas {blocks}", flush=True)
    failed = False
    for case in cases:
        for line in compare(case, blocks):
            print(line, flush=True)
            failed |= not line.endswith("PASS")
    chosen = sweep(sweep_seq, candidates, dtype, repeats) if sweep_seq else None
    chosen = chosen or blocks
    print(f"blocks: {chosen.block_q},{chosen.block_k},{chosen.num_warps},{chosen.num_stages}", flush=True)
    if failed:
        print("FAIL: a Pallas kernel disagrees with the XLA path or does not compile here; keep it off by default", file=sys.stderr)
    return 1 if failed else 0
