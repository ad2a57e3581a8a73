"""Block-sparse attention grouped by key block: the XLA formulation whose cost follows the choice.

Each query attends S blocks of J keys: its own (causally) and the earlier ones it chose
(``block_sparse._select``). Gathering every query's S x J keys moves S x J x D numbers per
query and makes the scores per-query matrix-vector products. Here the work is turned around, the
way FlashMoBA organises it: the (query, block) pairs are sorted by block and cut into tiles of R
pairs that all read the *same* block, so a tile is one [R x G, D] x [D, J] product and the only
per-pair traffic is its query row (G x D numbers, J times less). A block chosen by c queries
fills ceil(c / R) tiles, the last one part-padded: at most one tile of padding per block.
The causal mask is one rule for every tile: query t sees key j of block n iff t >= n J + j
(always true for an earlier block).

The tiles go in chunks of ``CHUNK`` through ``lax.map`` / ``lax.scan``, so one chunk's gathered
rows and products are all that is alive at a time (on this CPU a buffer's first touch costs
about as much as the arithmetic on it: BUILD_NOTES).

* forward, one pass: exponents against each query's own-block maximum m (always chosen, so m is
  at most the lse), [exp(s - m) V | exp(s - m)] added into the query's row (a scatter-add:
  cheaper than a gather on CPU), then out = acc / l and lse = m + log l. Where a score lies so
  far above m that a sum overflows, a ``lax.cond`` takes the exact two-pass forward: (1) the tile
  scores s (kept) and each pair's log-sum-exp, joined per query (a gather by the pair's slot)
  into the query's lse; (2) p = exp(s - lse), p V added into the query's output row.
* backward (``jax.custom_vjp``): flash attention's, one pass: p from lse, dq = ds k added into
  the query's row, dk = ds^T q and dv = p^T do added into the tile's block.

Letters: X tiles, R pairs per tile, S slots per query, N blocks, J keys per block, M chunks of
tiles, W query rows (flattened over batch, KV head and position), Z key blocks (flattened over
batch, KV head and block).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax.attention.common import Array, stats_dtype

TILE = 32  # pairs per tile (measured: BUILD_NOTES, "Block-sparse attention")
CHUNK = 256  # tiles per scan step


class Layout(NamedTuple):
    """Where each (query, block) pair sits in the tiles (integers; no gradient).
    ``rows`` [X * R]: the query row of each tile slot, W (one past the last row) if empty;
    ``blocks`` [X]: the key block each tile reads;
    ``dest``, ``pairs`` [B K, T S]: each head's pairs in block order, their tile slot (X * R if the
    query's slot is empty) and their index t S + s (only the two-pass forward needs them: ``slots``)."""

    rows: Array
    blocks: Array
    dest: Array
    pairs: Array


def slots(layout: Layout, shape_BKTS: tuple[int, ...]) -> Array:
    """[B, K, T, S]: each pair's tile slot, X * R if the query's slot is empty."""
    heads, p = layout.pairs.shape
    return jnp.zeros((heads, p), jnp.int32).at[jnp.arange(heads)[:, None], layout.pairs].set(layout.dest).reshape(shape_BKTS)


def tiling(pairs: int, blocks: int, tile: int, chunk: int) -> tuple[int, int]:
    """(tiles, tiles per scan step): enough for any choice (every pair, plus one part-filled
    tile per block), in whole steps of at most ``chunk`` tiles."""
    need = -(-pairs // tile) + blocks
    chunk = max(1, min(chunk, need))
    return -(-need // chunk) * chunk, chunk


def packs(num_blocks: int, pairs_per_head: int) -> bool:
    """Whether (block, pair) of a head fit one int32 sort key (below ~45k tokens at 16 x 16 blocks)."""
    return (num_blocks + 1) * pairs_per_head < 2**31


def _sort_by_block(block_HP: Array, packed: bool) -> tuple[Array, Array]:
    """(block, pair) of each head's pairs sorted by block [BK, P]. One int32 key packing both
    sorts ~5x faster on CPU than a sort carrying the pair as a second operand (BUILD_NOTES)."""
    heads, p = block_HP.shape
    pair_HP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (heads, p))
    if not packed:
        return jax.lax.sort((block_HP, pair_HP), dimension=1, num_keys=1)
    key_HP = jnp.sort(block_HP * p + pair_HP, axis=1)
    return key_HP // p, key_HP % p


def pair_layout(idx_BKTS: Array, num_blocks: int, *, tile: int = TILE, chunk: int = CHUNK, packed: bool | None = None) -> Layout:
    """The tiles of the pairs ``idx_BKTS`` (each query's blocks; -1: an empty slot).
    ``packed``: how to sort (None: one packed key when it fits int32)."""
    b, kh, t, s = idx_BKTS.shape
    heads, p = b * kh, t * s
    x, _ = tiling(heads * p, heads * num_blocks, tile, chunk)
    # empty slots take block N: they sort after every real pair
    block_HP = jnp.where(idx_BKTS >= 0, idx_BKTS, num_blocks).reshape(heads, p)
    block_HP, pair_HP = _sort_by_block(block_HP, packs(num_blocks, p) if packed is None else packed)
    first_HN = jax.vmap(lambda x: jnp.searchsorted(x, jnp.arange(num_blocks + 1, dtype=jnp.int32)))(block_HP).astype(jnp.int32)
    tiles_HN = -(-(first_HN[:, 1:] - first_HN[:, :-1]) // tile)
    tile_end_HN = jnp.cumsum(tiles_HN.reshape(-1)).reshape(heads, num_blocks)
    real_HP = block_HP < num_blocks
    block_safe_HP = jnp.minimum(block_HP, num_blocks - 1)
    start_HP, first_HP = (jnp.take_along_axis(a, block_safe_HP, axis=1) for a in (tile_end_HN - tiles_HN, first_HN))
    dest_HP = jnp.where(real_HP, start_HP * tile + jnp.arange(p, dtype=jnp.int32) - first_HP, x * tile)
    # query rows are [B, K, T] flattened (``_rows``): head h = (b, kv), so row = h T + t
    row_HP = jnp.arange(heads, dtype=jnp.int32)[:, None] * t + pair_HP // s
    rows = jnp.full(x * tile + 1, b * t * kh, jnp.int32).at[dest_HP].set(row_HP)[:-1]
    # tile i reads the block whose tiles end first after i; unused tiles clamp to the last block
    blocks = jnp.searchsorted(tile_end_HN.reshape(-1), jnp.arange(x, dtype=jnp.int32), side="right")
    return Layout(rows, jnp.minimum(blocks, heads * num_blocks - 1).astype(jnp.int32), dest_HP, pair_HP)


def _chunks(layout: Layout, tile: int, chunk: int) -> tuple[Array, Array]:
    """(rows [M, chunk x R], blocks [M, chunk]): the scan's inputs."""
    chunk = max(1, min(chunk, layout.blocks.shape[0]))  # as ``tiling`` chose
    return layout.rows.reshape(-1, chunk * tile), layout.blocks.reshape(-1, chunk)


def _gather_rows(x_W_: Array, rows_Z: Array, tile: int) -> Array:
    """Rows [W, ...] at a chunk's slots -> [chunk, R, ...]; an empty slot reads the last row
    (masked by ``_visible``). XLA's CPU gather costs about one cache miss per row whatever its
    width (BUILD_NOTES), so each pass gathers every per-row value it needs in one row."""
    y = jnp.take(x_W_, rows_Z, axis=0, mode="clip")
    return y.reshape(-1, tile, *y.shape[1:])


def _scatter_rows(acc_W_: Array, rows_Z: Array, x_Z_: Array) -> Array:
    """acc[rows] += x, x [Z, ...] or [X, R, ...] (out-of-range rows dropped). Cheaper than a
    gather of as many rows on CPU."""
    return acc_W_.at[rows_Z].add(x_Z_.reshape(rows_Z.shape[0], *acc_W_.shape[1:]), mode="drop")


class _Shape(NamedTuple):
    """What the tile steps need to know of the problem (static)."""

    rows: int  # W = B T K
    seq: int  # T
    num_blocks: int  # N
    block: int  # J


def _visible(rows_Z: Array, blocks_X: Array, shape: _Shape) -> Array:
    """[X, R, 1, J]: the slot holds a pair and its query t sees key j of its tile's block n
    (t >= n J + j: the causal rule, only ever false in the query's own block)."""
    t_XR = (rows_Z % shape.seq).reshape(blocks_X.shape[0], -1)
    key_XJ = (blocks_X % shape.num_blocks)[:, None] * shape.block + jnp.arange(shape.block)
    filled_XR = (rows_Z < shape.rows).reshape(t_XR.shape)
    return ((t_XR[:, :, None] >= key_XJ[:, None, :]) & filled_XR[:, :, None])[:, :, None, :]


def _rows(x_BTK_: Array) -> Array:
    """[B, T, K, ...] -> query rows [W, ...] in (b, kv, t) order: one head's rows are contiguous,
    so a tile's gathers and scatter-adds stay within T rows instead of striding over B T K
    (10% of the 16k forward: BUILD_NOTES)."""
    b, t, kh = x_BTK_.shape[:3]
    return jnp.swapaxes(x_BTK_, 1, 2).reshape(b * kh * t, *x_BTK_.shape[3:])


def _unrows(x_W_: Array, b: int, t: int, kh: int) -> Array:
    """The inverse of ``_rows``: [W, ...] -> [B, T, K, ...]."""
    return jnp.swapaxes(x_W_.reshape(b, kh, t, *x_W_.shape[1:]), 1, 2)


def _blocks_of(x_BTKD: Array, block: int, transpose: bool = False) -> Array:
    """[B,T,K,D] -> key blocks [Z, J, D] (Z = (b, kv, n) flattened), or [Z, D, J]: a plain (not
    transposed) operand of q k^T, several times faster on CPU for these small products."""
    b, t, kh, d = x_BTKD.shape
    x_BKNJD = jnp.transpose(x_BTKD.reshape(b, t // block, block, kh, d), (0, 3, 1, 2, 4)).reshape(-1, block, d)
    return jnp.swapaxes(x_BKNJD, 1, 2) if transpose else x_BKNJD


def _tile_scores(q_XRGD: Array, k_XDJ: Array) -> Array:
    """[X, R, G, J] in float32 (float64 under x64)."""
    return jnp.einsum("xrgd,xdj->xrgj", q_XRGD, k_XDJ, preferred_element_type=stats_dtype(q_XRGD))


def _lse(s_XJ: Array) -> Array:
    """Log-sum-exp over the last axis; -inf for a row of -inf (lighter than ``jax.nn.logsumexp``)."""
    m_X = jnp.max(s_XJ, axis=-1)
    m_X = jnp.where(jnp.isfinite(m_X), m_X, 0.0)
    return m_X + jnp.log(jnp.sum(jnp.exp(s_XJ - m_X[..., None]), axis=-1))


def _own_block_max(q_BTKGD: Array, k_BTKD: Array, block: int) -> Array:
    """[B,T,K,G]: each query's largest score in its own block (keys nJ .. t, never empty), a lower
    bound on its lse: the one-pass forward's reference. Dense per block (T x J scores, no gather)."""
    b, t, kh, g, d = q_BTKGD.shape
    n = t // block
    q_BNIKGD, k_BNJKD = q_BTKGD.reshape(b, n, block, kh, g, d), k_BTKD.reshape(b, n, block, kh, d)
    s = jnp.einsum("bnikgd,bnjkd->bnkgij", q_BNIKGD, k_BNJKD, preferred_element_type=stats_dtype(q_BTKGD))
    causal_IJ = jnp.arange(block)[:, None] >= jnp.arange(block)[None, :]
    m_BNKGI = jnp.max(jnp.where(causal_IJ, s, -jnp.inf), axis=-1)
    return jnp.moveaxis(m_BNKGI, -1, 2).reshape(b, t, kh, g)


def _forward_one_pass(q_BTKGD, k_BTKD, v_BTKD, layout: Layout, block: int, tile: int, chunk: int):
    """(out, lse, ok): one pass, every exponent taken against the query's own-block maximum m
    instead of its lse: p~ = exp(s - m), out = sum p~ v / sum p~, lse = m + log sum p~. A key
    that underflows has probability below e^-87 (lse >= m); ``ok`` is False where some score lay
    so far above m that a sum overflowed (then the caller takes ``_forward_two_pass``)."""
    b, t, kh, g, d = q_BTKGD.shape
    f32 = stats_dtype(q_BTKGD)
    shape = _Shape(b * t * kh, t, t // block, block)
    m_BTKG = _own_block_max(q_BTKGD, k_BTKD, block)
    # per query row: q and m (one gather a chunk)
    row_WGC = _rows(jnp.concatenate([q_BTKGD.astype(f32), m_BTKG[..., None]], axis=-1))
    kT_ZDJ, v_ZJD = _blocks_of(k_BTKD.astype(f32), block, transpose=True), _blocks_of(v_BTKD.astype(f32), block)

    def step(acc_WGC, xs):
        rows_Z, blocks_X = xs
        row_XRGC = _gather_rows(row_WGC, rows_Z, tile)
        s_XRGJ = _tile_scores(row_XRGC[..., :d], kT_ZDJ[blocks_X])
        p_XRGJ = jnp.where(_visible(rows_Z, blocks_X, shape), jnp.exp(s_XRGJ - row_XRGC[..., d, None]), 0.0)
        o_XRGD = jnp.einsum("xrgj,xjd->xrgd", p_XRGJ, v_ZJD[blocks_X])
        return _scatter_rows(acc_WGC, rows_Z, jnp.concatenate([o_XRGD, jnp.sum(p_XRGJ, axis=-1, keepdims=True)], axis=-1)), None

    acc_WGC, _ = jax.lax.scan(step, jnp.zeros((shape.rows, g, d + 1), f32), _chunks(layout, tile, chunk))
    o_WGD, l_WG = acc_WGC[..., :d], acc_WGC[..., d]
    ok = jnp.all(jnp.isfinite(acc_WGC))  # every query sees its own block: l >= 1
    return _unrows(o_WGD / l_WG[..., None], b, t, kh), m_BTKG + _unrows(jnp.log(l_WG), b, t, kh), ok


def _forward_two_pass(q_BTKGD, k_BTKD, v_BTKD, layout: Layout, block: int, tile: int, chunk: int):
    """(out [B,T,K,G,D] float32, lse [B,T,K,G]) of the pre-scaled queries, exact at any score
    range: pass 1 keeps the tile scores and joins each query's lse, pass 2 adds exp(s - lse) v."""
    b, t, kh, g, d = q_BTKGD.shape
    f32 = stats_dtype(q_BTKGD)
    shape = _Shape(b * t * kh, t, t // block, block)
    q_WGD, kT_ZDJ, v_ZJD = _rows(q_BTKGD), _blocks_of(k_BTKD, block, transpose=True), _blocks_of(v_BTKD.astype(f32), block)
    chunks = _chunks(layout, tile, chunk)

    # pass 1: tile scores (kept, masked) and each pair's lse, joined per query
    def scores(xs):
        rows_Z, blocks_X = xs
        return jnp.where(_visible(rows_Z, blocks_X, shape), _tile_scores(_gather_rows(q_WGD, rows_Z, tile), kT_ZDJ[blocks_X]), -jnp.inf)

    s_MXRGJ = jax.lax.map(scores, chunks)
    slots_BKTS = slots(layout, (b, kh, t, layout.pairs.shape[1] // t))
    lse_BKTSG = jnp.take(_lse(s_MXRGJ).reshape(-1, g), slots_BKTS, axis=0, mode="fill", fill_value=-jnp.inf)
    lse_BTKG = jnp.transpose(_lse(jnp.swapaxes(lse_BKTSG, 3, 4)), (0, 2, 1, 3))  # every query sees itself: finite
    # pass 2: each slot's query lse by a scatter (empty slots +inf: p = 0); p V into the query's row
    lse_each_BKTSG = jnp.broadcast_to(jnp.transpose(lse_BTKG, (0, 2, 1, 3))[:, :, :, None], lse_BKTSG.shape)
    lse_MXRG = jnp.full((layout.rows.shape[0], g), jnp.inf, f32).at[slots_BKTS].set(lse_each_BKTSG, mode="drop").reshape(s_MXRGJ.shape[:-1])

    def accumulate(o_WGD, xs):
        rows_Z, blocks_X, s_XRGJ, lse_XRG = xs
        return _scatter_rows(o_WGD, rows_Z, jnp.einsum("xrgj,xjd->xrgd", jnp.exp(s_XRGJ - lse_XRG[..., None]), v_ZJD[blocks_X])), None

    o_WGD, _ = jax.lax.scan(accumulate, jnp.zeros(q_WGD.shape, f32), (*chunks, s_MXRGJ, lse_MXRG))
    return _unrows(o_WGD, b, t, kh), lse_BTKG


def _forward(q_BTKGD, k_BTKD, v_BTKD, layout: Layout, block: int, tile: int, chunk: int):
    """(out [B,T,K,G,D] float32, lse [B,T,K,G]) of the pre-scaled queries: the one-pass forward,
    or the two-pass one where a score lies more than ~88 above its query's own-block maximum (a
    sum overflowed float32; one ``lax.cond``, so only one of them runs)."""
    o, lse, ok = _forward_one_pass(q_BTKGD, k_BTKD, v_BTKD, layout, block, tile, chunk)
    return jax.lax.cond(ok, lambda: (o, lse), lambda: _forward_two_pass(q_BTKGD, k_BTKD, v_BTKD, layout, block, tile, chunk))


def _attend_fwd(q_BTKGD, k_BTKD, v_BTKD, layout, block, tile, chunk):
    o, lse = _forward(q_BTKGD, k_BTKD, v_BTKD, layout, block, tile, chunk)
    return (o, lse), (q_BTKGD, k_BTKD, v_BTKD, layout, o, lse)


def backward(block, tile, chunk, residuals, cotangents):
    """The VJP of ``grouped_attention``: residuals (q pre-scaled [B,T,K,G,D], k, v, layout, out
    [B,T,K,G,D] float32, lse [B,T,K,G]), cotangents of (out, lse) -> (dq, dk, dv, None)."""
    q_BTKGD, k_BTKD, v_BTKD, layout, o_BTKGD, lse_BTKG = residuals
    do_BTKGD, dlse_BTKG = cotangents
    b, t, kh, g, d = q_BTKGD.shape
    f32 = stats_dtype(q_BTKGD)
    shape = _Shape(b * t * kh, t, t // block, block)
    # d lse / d s = p, so lse's cotangent joins the softmax's: ds = p (dp - delta + dlse)
    delta_BTKG = jnp.sum(do_BTKGD * o_BTKGD, axis=-1) - dlse_BTKG
    # per query row: q, do, lse, delta (one gather a chunk)
    row_WGC = _rows(jnp.concatenate([x.astype(f32) for x in (q_BTKGD, do_BTKGD, lse_BTKG[..., None], delta_BTKG[..., None])], axis=-1))
    k_ZJD, v_ZJD = _blocks_of(k_BTKD.astype(f32), block), _blocks_of(v_BTKD.astype(f32), block)

    def step(acc, xs):
        dq_WGD, dk_ZJD, dv_ZJD = acc
        rows_Z, blocks_X = xs
        row_XRGC = _gather_rows(row_WGC, rows_Z, tile)
        q_XRGD, do_XRGD, lse_XRG1, delta_XRG1 = row_XRGC[..., :d], row_XRGC[..., d : 2 * d], row_XRGC[..., 2 * d, None], row_XRGC[..., 2 * d + 1, None]
        k_XJD, v_XJD = k_ZJD[blocks_X], v_ZJD[blocks_X]
        p_XRGJ = jnp.where(_visible(rows_Z, blocks_X, shape), jnp.exp(_tile_scores(q_XRGD, jnp.swapaxes(k_XJD, 1, 2)) - lse_XRG1), 0.0)
        ds_XRGJ = p_XRGJ * (_tile_scores(do_XRGD, jnp.swapaxes(v_XJD, 1, 2)) - delta_XRG1)
        dq_WGD = _scatter_rows(dq_WGD, rows_Z, jnp.einsum("xrgj,xjd->xrgd", ds_XRGJ, k_XJD))
        dk_ZJD = dk_ZJD.at[blocks_X].add(jnp.einsum("xrgj,xrgd->xjd", ds_XRGJ, q_XRGD))
        dv_ZJD = dv_ZJD.at[blocks_X].add(jnp.einsum("xrgj,xrgd->xjd", p_XRGJ, do_XRGD))
        return (dq_WGD, dk_ZJD, dv_ZJD), None

    zeros = jnp.zeros(k_ZJD.shape, f32)
    (dq_WGD, dk_ZJD, dv_ZJD), _ = jax.lax.scan(step, (jnp.zeros((shape.rows, g, d), f32), zeros, zeros), _chunks(layout, tile, chunk))
    n = shape.num_blocks
    dk_BTKD, dv_BTKD = (jnp.transpose(x.reshape(b, kh, n, block, d), (0, 2, 3, 1, 4)).reshape(b, t, kh, d) for x in (dk_ZJD, dv_ZJD))
    return _unrows(dq_WGD, b, t, kh).astype(q_BTKGD.dtype), dk_BTKD.astype(k_BTKD.dtype), dv_BTKD.astype(v_BTKD.dtype), None


grouped_attention = jax.custom_vjp(_forward, nondiff_argnums=(4, 5, 6))
grouped_attention.defvjp(_attend_fwd, backward)
grouped_attention.__doc__ = """(out [B,T,K,G,D] float32, lse [B,T,K,G]) of pre-scaled queries q [B,T,K,G,D] over the
blocks of ``layout`` (``pair_layout``; slot 0 the query's own block, attended causally); k, v
[B,T,K,D]; T a multiple of ``block``; pairs in tiles of ``tile``, ``chunk`` tiles a step."""
