"""Dense causal attention in XLA: the baseline, and the peer of the test oracle.

Flash attention's arithmetic in XLA, with its own backward (``jax.custom_vjp``): queries go in
chunks of ``query_chunk``; the forward keeps only the output and the log-sum-exp, and the
backward recomputes each chunk's probabilities from the log-sum-exp (p = exp(s - lse)) instead of
differentiating through the softmax, so one chunk's [C, T] scores are alive at a time and none
of the softmax's intermediates is kept or differentiated. Up to ``unroll_max_len`` tokens the chunks are
a Python loop and each reads only the keys before its end (the causal triangle: about half the
work of a [T, T] product); beyond it the chunks go in ``key_segments`` runs, each a ``lax.map``
(backward: ``lax.scan``) over its chunks reading the keys up to the run's end: with 8 even runs,
about 9/16 of a [T, T] product at any T, in a program whose size does not grow with T.
Measurements: BUILD_NOTES.md, "Attention paths", "Dense".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fibjax.attention.common import Array, finish, group_queries, stats_dtype

QUERY_CHUNK = 256
UNROLL_MAX_LEN = 4096
KEY_SEGMENTS = 8  # beyond UNROLL_MAX_LEN: mapped runs of chunks, each reading the keys up to its end


def _causal_mask(start, rows: int, chunk: int, key_len: int) -> Array:
    """[rows, key_len]: row r is the query at start + r % chunk (rows are G groups of a chunk)."""
    return (start + jnp.arange(rows) % chunk)[:, None] >= jnp.arange(key_len)[None, :]


def _chunk_forward(q_BKMD: Array, k_BKTD: Array, v_BKTD: Array, start, chunk: int) -> tuple[Array, Array]:
    """One chunk's queries (M = G x C rows) against the keys given: output [B,K,M,D] float32, lse [B,K,M]."""
    f32 = stats_dtype(k_BKTD)
    s_BKMT = jnp.einsum("bkmd,bktd->bkmt", q_BKMD, k_BKTD, preferred_element_type=f32)
    s_BKMT = jnp.where(_causal_mask(start, s_BKMT.shape[2], chunk, s_BKMT.shape[3]), s_BKMT, -jnp.inf)
    m_BKM = jnp.max(s_BKMT, axis=-1)  # every query sees its own key: finite
    p_BKMT = jnp.exp(s_BKMT - m_BKM[..., None])
    l_BKM = jnp.sum(p_BKMT, axis=-1)
    o_BKMD = jnp.einsum("bkmt,bktd->bkmd", p_BKMT, v_BKTD.astype(f32)) / l_BKM[..., None]
    return o_BKMD, m_BKM + jnp.log(l_BKM)


def _chunk_backward(k_BKTD, v_BKTD, start, chunk: int, q_BKMD, lse_BKM, do_BKMD, dlse_BKM, delta_BKM):
    """Gradients of one chunk: dq [B,K,M,D] and this chunk's share of dk, dv [B,K,T,D] (float32)."""
    f32 = stats_dtype(k_BKTD)
    s_BKMT = jnp.einsum("bkmd,bktd->bkmt", q_BKMD, k_BKTD, preferred_element_type=f32)
    p_BKMT = jnp.where(_causal_mask(start, s_BKMT.shape[2], chunk, s_BKMT.shape[3]), jnp.exp(s_BKMT - lse_BKM[..., None]), 0.0)
    dv_BKTD = jnp.einsum("bkmt,bkmd->bktd", p_BKMT, do_BKMD)
    dp_BKMT = jnp.einsum("bkmd,bktd->bkmt", do_BKMD, v_BKTD.astype(f32))
    # d lse / d s = p, so lse's cotangent joins the softmax's: ds = p (dp - delta + dlse)
    ds_BKMT = p_BKMT * (dp_BKMT - (delta_BKM - dlse_BKM)[..., None])
    dq_BKMD = jnp.einsum("bkmt,bktd->bkmd", ds_BKMT, k_BKTD.astype(f32))
    dk_BKTD = jnp.einsum("bkmt,bkmd->bktd", ds_BKMT, q_BKMD.astype(f32))
    return dq_BKMD, dk_BKTD, dv_BKTD


def _rows(x_BKGT_: Array, start: int, stop: int) -> Array:
    """Queries [start, stop) of every group as rows: [B, K, G, T, ...] -> [B, K, G x C, ...]."""
    y = x_BKGT_[:, :, :, start:stop]
    return y.reshape(*y.shape[:2], -1, *y.shape[4:])


def _unrows(x_BKM_: Array, groups: int) -> Array:
    """[B, K, G x C, ...] -> [B, K, G, C, ...]."""
    b, kh, m = x_BKM_.shape[:3]
    return x_BKM_.reshape(b, kh, groups, m // groups, *x_BKM_.shape[3:])


def _spans(t: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, t)) for s in range(0, t, chunk)]


def _split(x_BKGT_: Array, chunk: int) -> Array:
    """Whole chunks as a leading axis: [B, K, G, N x C, ...] -> [N, B, K, G x C, ...]."""
    b, kh, g, t = x_BKGT_.shape[:4]
    y = x_BKGT_.reshape(b, kh, g, t // chunk, chunk, *x_BKGT_.shape[4:])
    return jnp.moveaxis(y, 3, 0).reshape(t // chunk, b, kh, g * chunk, *x_BKGT_.shape[4:])


def _merge(y_NBKM_: Array, groups: int) -> Array:
    """The inverse of ``_split``: [N, B, K, G x C, ...] -> [B, K, G, N x C, ...]."""
    n, b, kh, m = y_NBKM_.shape[:4]
    y = y_NBKM_.reshape(n, b, kh, groups, m // groups, *y_NBKM_.shape[4:])
    return jnp.moveaxis(y, 0, 3).reshape(b, kh, groups, n * (m // groups), *y_NBKM_.shape[4:])


def _segments(t: int, chunk: int, unroll: bool, key_segments: int) -> list[tuple[int, int]]:
    """Query ranges [start, stop), each attending keys [0, stop): one per chunk when unrolled;
    else ``key_segments`` runs of whole chunks, each a ``lax.map`` over its chunks."""
    if unroll:
        return _spans(t, chunk)
    n = t // chunk
    bounds = [round(i * n / min(key_segments, n)) * chunk for i in range(min(key_segments, n) + 1)]  # as even as whole chunks allow
    return list(zip(bounds[:-1], bounds[1:]))


def _forward(q_BKGTD: Array, k_BKTD: Array, v_BKTD: Array, chunk: int, unroll: bool, key_segments: int) -> tuple[Array, Array]:
    """Output [B,K,G,T,D] float32 and lse [B,K,G,T] of the pre-scaled queries."""
    g, t = q_BKGTD.shape[2:4]
    parts = []
    for s, e in _segments(t, chunk, unroll, key_segments):
        k_seg, v_seg = k_BKTD[:, :, :e], v_BKTD[:, :, :e]
        if e - s <= chunk:
            parts.append(tuple(_unrows(x, g) for x in _chunk_forward(_rows(q_BKGTD, s, e), k_seg, v_seg, s, e - s)))
            continue
        starts_N = s + jnp.arange((e - s) // chunk, dtype=jnp.int32) * chunk
        o_N, lse_N = jax.lax.map(lambda xs: _chunk_forward(xs[0], k_seg, v_seg, xs[1], chunk), (_split(q_BKGTD[:, :, :, s:e], chunk), starts_N))
        parts.append((_merge(o_N, g), _merge(lse_N, g)))
    return tuple(jnp.concatenate(xs, axis=3) for xs in zip(*parts))


def _attend_fwd(q_BKGTD, k_BKTD, v_BKTD, chunk, unroll, key_segments):
    o_BKGTD, lse_BKGT = _forward(q_BKGTD, k_BKTD, v_BKTD, chunk, unroll, key_segments)
    return (o_BKGTD, lse_BKGT), (q_BKGTD, k_BKTD, v_BKTD, o_BKGTD, lse_BKGT)


def _attend_bwd(chunk, unroll, key_segments, residuals, cotangents):
    q_BKGTD, k_BKTD, v_BKTD, o_BKGTD, lse_BKGT = residuals
    do_BKGTD, dlse_BKGT = cotangents
    per_query = (q_BKGTD, lse_BKGT, do_BKGTD, dlse_BKGT, jnp.sum(do_BKGTD * o_BKGTD, axis=-1))  # the last: delta
    g, t = q_BKGTD.shape[2:4]
    dk_BKTD, dv_BKTD = jnp.zeros(k_BKTD.shape, jnp.float32), jnp.zeros(v_BKTD.shape, jnp.float32)
    dq_parts = []
    for s, e in _segments(t, chunk, unroll, key_segments):
        k_seg, v_seg = k_BKTD[:, :, :e], v_BKTD[:, :, :e]
        if e - s <= chunk:
            dq, dk, dv = _chunk_backward(k_seg, v_seg, s, e - s, *(_rows(x, s, e) for x in per_query))
            dq = _unrows(dq, g)
        else:

            def step(carry, xs, k_seg=k_seg, v_seg=v_seg):
                dq, dk, dv = _chunk_backward(k_seg, v_seg, xs[0], chunk, *xs[1:])
                return (carry[0] + dk, carry[1] + dv), dq

            starts_N = s + jnp.arange((e - s) // chunk, dtype=jnp.int32) * chunk
            zeros = jnp.zeros(k_seg.shape, jnp.float32)
            (dk, dv), dq_N = jax.lax.scan(step, (zeros, zeros), (starts_N, *(_split(x[:, :, :, s:e], chunk) for x in per_query)))
            dq = _merge(dq_N, g)
        dq_parts.append(dq)
        dk_BKTD, dv_BKTD = dk_BKTD.at[:, :, :e].add(dk), dv_BKTD.at[:, :, :e].add(dv)
    dq_BKGTD = jnp.concatenate(dq_parts, axis=3)
    return tuple(d.astype(x.dtype) for d, x in ((dq_BKGTD, q_BKGTD), (dk_BKTD, k_BKTD), (dv_BKTD, v_BKTD)))


_attend = jax.custom_vjp(_forward, nondiff_argnums=(3, 4, 5))
_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.jit, static_argnames=("return_lse", "query_chunk", "unroll_max_len", "key_segments"))
def dense_attention_xla(
    q: Array,
    k: Array,
    v: Array,
    *,
    return_lse: bool = False,
    query_chunk: int = QUERY_CHUNK,
    unroll_max_len: int = UNROLL_MAX_LEN,
    key_segments: int = KEY_SEGMENTS,
):
    """Causal softmax attention [B,T,H,D] (k, v [B,T,K,D]), flash attention's arithmetic in XLA
    (module docstring); ``return_lse`` adds the log-sum-exp [B,T,H] float32."""
    if query_chunk < 1 or key_segments < 1:
        raise ValueError(f"query_chunk and key_segments must be >= 1, got {query_chunk}, {key_segments}")
    t = q.shape[1]
    chunk = min(query_chunk, t)
    unroll = t <= unroll_max_len
    t_pad = t if unroll else -(-t // chunk) * chunk  # the map needs whole chunks; padded queries are dropped
    q_BKGTD = jnp.moveaxis(group_queries(q, k.shape[2]), 1, 3)
    q_BKGTD = jnp.pad(q_BKGTD, ((0, 0), (0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    k_BKTD, v_BKTD = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    o_BKGTD, lse_BKGT = _attend(q_BKGTD, k_BKTD, v_BKTD, chunk, unroll, key_segments)
    return finish(jnp.moveaxis(o_BKGTD, 3, 1), jnp.moveaxis(lse_BKGT, 3, 1), q, return_lse)
