"""Dense causal attention in XLA: the baseline, and the peer of the test oracle.

Flash attention's arithmetic in XLA, with its own backward (``jax.custom_vjp``): queries go in
chunks of ``query_chunk``, and each chunk reads its keys in tiles of ``KEY_TILE`` (a loop with an
online softmax), so one tile's [C, W] scores are alive at a time and stay in cache (a chunk's whole
[C, T] scores at a time were most of the time: 8 heads x 256 x 4096 float32 is 32 MB); tiles past
a chunk's end are not read, and the forward skips the causal mask on those wholly before it. The
forward keeps only the output and the log-sum-exp, and the backward recomputes each tile's
probabilities from the log-sum-exp (p = exp(s - lse)) instead of differentiating through the
softmax. Up to ``unroll_max_len`` tokens the chunks are a Python loop; beyond it the chunks go in
``key_segments`` runs, each a ``lax.map`` (backward: ``lax.scan``) over its chunks, in a program
whose size does not grow with T (the tile loops' trip counts follow each chunk's end, so the runs
no longer decide how many keys a chunk reads). Measurements: BUILD_NOTES.md, "Attention paths",
"Dense".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fibjax.attention.common import Array, finish, group_queries, stats_dtype

QUERY_CHUNK = 512
KEY_TILE = 256  # a chunk's keys in tiles of this (or of the chunk, when smaller)
UNROLL_MAX_LEN = 4096
KEY_SEGMENTS = 8  # beyond UNROLL_MAX_LEN: mapped runs of chunks (the program's shape; each chunk reads only its causal keys)


def _tiles(x_BKTD: Array, tile: int) -> Array:
    """Keys in tiles along a leading axis, zero-padded to whole tiles: [B,K,T,D] -> [N,B,K,W,D]."""
    b, kh, t, d = x_BKTD.shape
    n = -(-t // tile)
    x_BKTD = jnp.pad(x_BKTD, ((0, 0), (0, 0), (0, n * tile - t), (0, 0)))
    return jnp.moveaxis(x_BKTD.reshape(b, kh, n, tile, d), 2, 0)


def _tile_loops(start, chunk: int, tile: int, n: int):
    """The key tiles a chunk reads, as two ranges: [0, below) wholly before its first query (no
    mask), [below, stop) up to its end (masked). Static when ``start`` is, else while-loop bounds."""
    if isinstance(start, int):
        return start // tile, min(-(-(start + chunk) // tile), n)
    return start // tile, jnp.minimum((start + chunk + tile - 1) // tile, n)


def _visible(start, rows: int, chunk: int, j0, tile: int) -> Array:
    """[rows, tile]: row r is the query at start + r % chunk (rows are G groups of a chunk), key j0 + w."""
    return (start + jnp.arange(rows) % chunk)[:, None] >= j0 + jnp.arange(tile)[None, :]


def _chunk_forward(q_BKMD: Array, k_BKTD: Array, v_BKTD: Array, start, chunk: int) -> tuple[Array, Array]:
    """One chunk's queries (M = G x C rows) against the keys given: output [B,K,M,D] float32, lse [B,K,M].
    Online softmax over key tiles of ``tile``, so one tile's [M, W] scores are alive at a time."""
    f32, tile = stats_dtype(k_BKTD), min(KEY_TILE, chunk)
    k_N, v_N = _tiles(k_BKTD, tile), _tiles(v_BKTD, tile)

    def step(i, carry, masked=True):
        m_BKM, l_BKM, o_BKMD = carry
        s_BKMW = jnp.einsum("bkmd,bkwd->bkmw", q_BKMD, k_N[i], preferred_element_type=f32)
        if masked:
            s_BKMW = jnp.where(_visible(start, s_BKMW.shape[2], chunk, i * tile, tile), s_BKMW, -jnp.inf)
        new_BKM = jnp.maximum(m_BKM, jnp.max(s_BKMW, axis=-1))  # tile 0 holds key 0, seen by all: finite from there on
        p_BKMW = jnp.exp(s_BKMW - new_BKM[..., None])
        scale_BKM = jnp.exp(m_BKM - new_BKM)
        o_BKMD = o_BKMD * scale_BKM[..., None] + jnp.einsum("bkmw,bkwd->bkmd", p_BKMW, v_N[i].astype(f32))
        return new_BKM, l_BKM * scale_BKM + jnp.sum(p_BKMW, axis=-1), o_BKMD

    b, kh, m, d = q_BKMD.shape
    below, stop = _tile_loops(start, chunk, tile, k_N.shape[0])
    carry = (jnp.full((b, kh, m), -jnp.inf, f32), jnp.zeros((b, kh, m), f32), jnp.zeros((b, kh, m, d), f32))
    carry = jax.lax.fori_loop(0, below, functools.partial(step, masked=False), carry)
    m_BKM, l_BKM, o_BKMD = jax.lax.fori_loop(below, stop, step, carry)
    return o_BKMD / l_BKM[..., None], m_BKM + jnp.log(l_BKM)


def _chunk_backward(k_BKTD, v_BKTD, start, chunk: int, q_BKMD, lse_BKM, do_BKMD, dlse_BKM, delta_BKM):
    """Gradients of one chunk: dq [B,K,M,D] and this chunk's share of dk, dv [B,K,T,D] (float32),
    over the same key tiles as the forward."""
    f32, tile = stats_dtype(k_BKTD), min(KEY_TILE, chunk)
    k_N, v_N = _tiles(k_BKTD, tile), _tiles(v_BKTD, tile)
    q32_BKMD = q_BKMD.astype(f32)
    # d lse / d s = p, so lse's cotangent joins the softmax's: ds = p (dp - delta + dlse)
    shift_BKM = delta_BKM - dlse_BKM

    def step(i, carry):
        dq_BKMD, dk_NBKWD, dv_NBKWD = carry
        s_BKMW = jnp.einsum("bkmd,bkwd->bkmw", q_BKMD, k_N[i], preferred_element_type=f32)
        p_BKMW = jnp.where(_visible(start, s_BKMW.shape[2], chunk, i * tile, tile), jnp.exp(s_BKMW - lse_BKM[..., None]), 0.0)
        dv_BKWD = jnp.einsum("bkmw,bkmd->bkwd", p_BKMW, do_BKMD)
        ds_BKMW = p_BKMW * (jnp.einsum("bkmd,bkwd->bkmw", do_BKMD, v_N[i].astype(f32)) - shift_BKM[..., None])
        dq_BKMD = dq_BKMD + jnp.einsum("bkmw,bkwd->bkmd", ds_BKMW, k_N[i].astype(f32))
        dk_BKWD = jnp.einsum("bkmw,bkmd->bkwd", ds_BKMW, q32_BKMD)
        return dq_BKMD, dk_NBKWD.at[i].set(dk_BKWD), dv_NBKWD.at[i].set(dv_BKWD)

    # one loop, every tile masked: split in two like the forward's, the loops' [N,B,K,W,D] carries
    # cost more than the mask saves (16384 tokens, fwd+bwd, loaded machine: 0.66 of the old time, not 0.53)
    zeros_N = jnp.zeros(k_N.shape, f32)  # tiles past the chunk's end stay zero
    stop = _tile_loops(start, chunk, tile, k_N.shape[0])[1]
    dq_BKMD, dk_NBKWD, dv_NBKWD = jax.lax.fori_loop(0, stop, step, (jnp.zeros(q_BKMD.shape, f32), zeros_N, zeros_N))
    b, kh, t, d = k_BKTD.shape
    untile = lambda x_NBKWD: jnp.moveaxis(x_NBKWD, 0, 2).reshape(b, kh, -1, d)[:, :, :t]  # noqa: E731
    return dq_BKMD, untile(dk_NBKWD), untile(dv_NBKWD)


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
