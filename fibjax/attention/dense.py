"""Dense causal attention in XLA: the baseline, and the peer of the test oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fibjax.attention.common import Array, finish, group_queries, masked_softmax, stats_dtype

QUERY_CHUNK = 256
UNROLL_MAX_LEN = 4096


def _chunk(q_BCKGD: Array, k: Array, v: Array, query_start, key_len: int):
    """Queries [start, start + C) against keys [0, key_len) under the causal mask."""
    c = q_BCKGD.shape[1]
    k, v = k[:, :key_len], v[:, :key_len]
    s_BKGCT = jnp.einsum("bckgd,btkd->bkgct", q_BCKGD, k, preferred_element_type=stats_dtype(k))
    causal_CT = (query_start + jnp.arange(c))[:, None] >= jnp.arange(key_len)[None, :]
    p_BKGCT, lse_BKGC = masked_softmax(s_BKGCT, causal_CT)
    o_BCKGD = jnp.einsum("bkgct,btkd->bckgd", p_BKGCT, v.astype(p_BKGCT.dtype))
    return o_BCKGD, jnp.transpose(lse_BKGC, (0, 3, 1, 2))


@functools.partial(jax.jit, static_argnames=("return_lse", "query_chunk", "unroll_max_len"))
def dense_attention_xla(q: Array, k: Array, v: Array, *, return_lse: bool = False, query_chunk: int = QUERY_CHUNK, unroll_max_len: int = UNROLL_MAX_LEN):
    """Causal softmax attention, queries in chunks, each rematerialised in the backward.

    Up to ``unroll_max_len`` tokens the chunks are a Python loop and each sees only the keys
    before its end (half the work of a [T, T] product), but XLA keeps every chunk's scores
    live (about 1 GB fwd+bwd at 4096, 14 GB at 16384). Beyond that a ``lax.map`` runs the
    chunks one at a time against all keys: 2x the arithmetic, O(chunk x T) memory.
    Measurements: BUILD_NOTES.md, "Dense attention".
    """
    b, t = q.shape[:2]
    q_BTKGD = group_queries(q, k.shape[2])
    if t <= query_chunk:
        o_BTKGD, lse_BTKG = _chunk(q_BTKGD, k, v, 0, t)
    elif t <= unroll_max_len:
        outs = [
            jax.checkpoint(_chunk, static_argnums=(3, 4))(q_BTKGD[:, s : s + query_chunk], k, v, s, min(s + query_chunk, t)) for s in range(0, t, query_chunk)
        ]
        o_BTKGD, lse_BTKG = (jnp.concatenate(x, axis=1) for x in zip(*outs))
    else:
        n = -(-t // query_chunk)
        q_pad = jnp.pad(q_BTKGD, ((0, 0), (0, n * query_chunk - t), (0, 0), (0, 0), (0, 0)))
        q_NBCKGD = jnp.moveaxis(q_pad.reshape(b, n, query_chunk, *q_BTKGD.shape[2:]), 1, 0)
        body = jax.checkpoint(lambda xs: _chunk(xs[0], k, v, xs[1], t))
        o_N, lse_N = jax.lax.map(body, (q_NBCKGD, jnp.arange(n, dtype=jnp.int32) * query_chunk))
        o_BTKGD = jnp.moveaxis(o_N, 0, 1).reshape(b, n * query_chunk, *q_BTKGD.shape[2:])
        lse_BTKG = jnp.moveaxis(lse_N, 0, 1).reshape(b, n * query_chunk, *q_BTKGD.shape[2:4])
    return finish(o_BTKGD, lse_BTKG, q, return_lse)
