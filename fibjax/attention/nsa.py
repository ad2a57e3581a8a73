"""NSA (Native Sparse Attention, Yuan et al. 2025) in XLA: paper B's gated three-branch baseline.

Query i (RoPE'd q, k, v shared by the branches) mixes three attentions with its own per-head
gates g [B,T,H,3] in [0, 1] (sigmoids the model computes from the layer input):

    o_i = g_cmp o_cmp + g_slc o_slc + g_win o_win

* compressed: softmax over the compressed blocks k_cmp[n], v_cmp[n] (one key and value per block
  of B = ``block_size`` keys, from [compress_blocks][fibjax.attention.compress_blocks]) that lie wholly in the query's past,
  (n + 1) B - 1 <= i; a query before the end of block 0 sees none and o_cmp = 0;
* selected: its own block (causally) and the S-1 earlier blocks (S = ``num_blocks``) with the
  largest sum over the G query heads of its KV group of that head's compressed-branch softmax
  probability (NSA eq. 9-10; the choice of ``block_sparse`` with ``block_rank="nsa_prob"`` and
  k_cmp as the block keys; no gradient through the choice; ties to the lower block);
* window: keys i - W .. i (W = ``window``, the repo's window {0..W}: W + 1 keys).

The compressed branch and the choice share one softmax per query chunk (the ranking reads the
branch's probabilities rather than recomputing them); the selected branch is ``block_sparse``'s
attention over that choice; the window is a flash-style band. Figures: BUILD_NOTES.md, "NSA".

Compression and selection share one blocking (block length = stride = selection block), as the
reference code (fla-org/native-sparse-attention, used by paper B) does. Decisions and deviations
from the NSA paper: BUILD_NOTES.md, "NSA".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention import block_grouped, block_sparse
from fibjax.attention.block_sparse import QUERY_CHUNK, check_budget, check_rank_keys
from fibjax.attention.common import Array, check_qkv, group_queries, stats_dtype

BRANCHES = ("cmp", "slc", "win")  # the order of the gates' last axis
# Queries per step of the window band: each reads C + W keys, so smaller is less waste until
# the steps' overhead dominates (measured: BUILD_NOTES, "NSA")
WINDOW_CHUNK = 64


def compress_blocks(x_BTKD: Array, pos_JD: Array, w_in_XF: Array, w_out_FD: Array) -> Array:
    """NSA's learned block compression phi, per KV head (weights shared by the heads):

        phi(X_n) = mean_j x_{nJ+j} + relu(vec(X_n + P) W_in) W_out,   X_n = x_{nJ} .. x_{nJ+J-1}

    [B,T,K,D] -> [B,N,K,D] over the N = T // J complete blocks (J = pos rows; P the intra-block
    position embedding [J, D], W_in [J*D, F], W_out [F, D]). The mean is the reference code's
    whole compression; the MLP is the paper's learned phi, added on top so that W_out = 0 (the
    model's initialisation) is exactly the reference. Computed in x's dtype, the mean in float32.

    Args:
        x_BTKD: Keys or values [B,T,K,D].
        pos_JD: The intra-block position embedding P [J, D].
        w_in_XF: W_in [J*D, F].
        w_out_FD: W_out [F, D].

    Returns:
        The compressed blocks [B,N,K,D] in x's dtype.
    """
    b, t, kh, d = x_BTKD.shape
    j = pos_JD.shape[0]
    n = t // j
    x_BNJKD = x_BTKD[:, : n * j].reshape(b, n, j, kh, d)
    mean_BNKD = jnp.mean(x_BNJKD.astype(jnp.float32), axis=2)
    z_BNKX = jnp.moveaxis(x_BNJKD + pos_JD[:, None, :], 2, 3).reshape(b, n, kh, j * d)
    mlp_BNKD = jax.nn.relu(z_BNKX @ w_in_XF) @ w_out_FD
    return (mean_BNKD + mlp_BNKD.astype(jnp.float32)).astype(x_BTKD.dtype)


def _compressed_chunk(q_BKGCD: Array, k_BKND: Array, v_BKND: Array, query_start, *, block: int, top: int):
    """Queries query_start + [0, C) (unscaled) against the compressed blocks wholly in their past:
    output [B,K,G,C,D] float32, lse [B,K,G,C], and the selection [B,K,C,top] ranked by the same
    probabilities (summed over the group)."""
    p_BKGCN, lse_BKGC = block_sparse.group_probabilities(q_BKGCD, k_BKND, query_start, block=block)
    idx_BKCE = block_sparse.top_earlier(jnp.sum(p_BKGCN, axis=2), query_start, block=block, top=top)
    return jnp.einsum("bkgcn,bknd->bkgcd", p_BKGCN, v_BKND), lse_BKGC, idx_BKCE


def _compressed_forward(q_BKGTD: Array, k_BKND: Array, v_BKND: Array, block: int, top: int, chunk: int):
    """(out [B,K,G,T,D] float32, lse [B,K,G,T], choice [B,K,T,top]) in runs of query chunks."""
    body = functools.partial(_compressed_chunk, block=block, top=top)
    return block_sparse.in_runs(body, q_BKGTD, (k_BKND, v_BKND), block=block, chunk=chunk, axes=(3, 3, 2))


def _compressed_fwd(q_BKGTD, k_BKND, v_BKND, block, top, chunk):
    o_BKGTD, lse_BKGT, idx_BKTE = _compressed_forward(q_BKGTD, k_BKND, v_BKND, block, top, chunk)
    return (o_BKGTD, lse_BKGT, idx_BKTE), (q_BKGTD, k_BKND, v_BKND, o_BKGTD, lse_BKGT)


def _compressed_chunk_backward(k_BKND, v_BKND, start, q_BKGCD, lse_BKGC, do_BKGCD, dlse_BKGC, delta_BKGC, *, block: int):
    """Flash attention's backward for one chunk: p recomputed from the lse (zero where a block is
    not yet complete, and for a query that sees none), ds = p (dp - delta + dlse); dq [B,K,G,C,D]
    and this chunk's dk, dv [B,K,N,D]."""
    c, d = q_BKGCD.shape[3:]
    hi, scale = jax.lax.Precision.HIGHEST, 1.0 / math.sqrt(d)
    s_BKGCN = jnp.einsum("bkgcd,bknd->bkgcn", q_BKGCD, k_BKND, precision=hi) * scale
    past_CN = jnp.arange(k_BKND.shape[2])[None, :] < ((start + jnp.arange(c) + 1) // block)[:, None]
    lse_BKGC = jnp.where(jnp.isfinite(lse_BKGC), lse_BKGC, 0.0)
    p_BKGCN = jnp.where(past_CN, jnp.exp(s_BKGCN - lse_BKGC[..., None]), 0.0)
    dp_BKGCN = jnp.einsum("bkgcd,bknd->bkgcn", do_BKGCD, v_BKND, precision=hi)
    ds_BKGCN = p_BKGCN * (dp_BKGCN - (delta_BKGC - dlse_BKGC)[..., None]) * scale
    dq_BKGCD = jnp.einsum("bkgcn,bknd->bkgcd", ds_BKGCN, k_BKND, precision=hi)
    dk_BKND = jnp.einsum("bkgcn,bkgcd->bknd", ds_BKGCN, q_BKGCD, precision=hi)
    dv_BKND = jnp.einsum("bkgcn,bkgcd->bknd", p_BKGCN, do_BKGCD, precision=hi)
    return dq_BKGCD, dk_BKND, dv_BKND


def _compressed_bwd(block, top, chunk, residuals, cotangents):
    """The runs of the forward again: each run scans its chunks, reading (and adding dk, dv into)
    only the blocks before its end. The choice is an integer output: no cotangent."""
    q_BKGTD, k_BKND, v_BKND, o_BKGTD, lse_BKGT = residuals
    do_BKGTD, dlse_BKGT, _ = cotangents
    per_query = (q_BKGTD.astype(jnp.float32), lse_BKGT, do_BKGTD, dlse_BKGT, jnp.sum(do_BKGTD * o_BKGTD, axis=-1))  # the last: delta
    dk_BKND, dv_BKND = jnp.zeros(k_BKND.shape, jnp.float32), jnp.zeros(v_BKND.shape, jnp.float32)
    dq_parts = []
    for s, e in block_sparse.run_bounds(q_BKGTD.shape[3], chunk):
        n = e // block
        k_seg, v_seg = k_BKND[:, :, :n], v_BKND[:, :, :n]

        def step(carry, xs, k_seg=k_seg, v_seg=v_seg):
            dq, dk, dv = _compressed_chunk_backward(k_seg, v_seg, xs[0], *xs[1:], block=block)
            return (carry[0] + dk, carry[1] + dv), dq

        chunks = (block_sparse.chunk_starts(s, e, chunk), *(block_sparse.split_chunks(x, s, e, chunk) for x in per_query))
        zeros = jnp.zeros(k_seg.shape, jnp.float32)
        (dk, dv), dq_MBKGCD = jax.lax.scan(step, (zeros, zeros), chunks)
        dq_parts.append(block_sparse.merge_chunks(dq_MBKGCD, 3))
        dk_BKND, dv_BKND = dk_BKND.at[:, :, :n].add(dk), dv_BKND.at[:, :, :n].add(dv)
    dq_BKGTD = jnp.concatenate(dq_parts, axis=3)
    return dq_BKGTD.astype(q_BKGTD.dtype), dk_BKND.astype(k_BKND.dtype), dv_BKND.astype(v_BKND.dtype)


_compressed = jax.custom_vjp(_compressed_forward, nondiff_argnums=(3, 4, 5))
_compressed.defvjp(_compressed_fwd, _compressed_bwd)


def _compressed_and_choice(q: Array, k_cmp: Array, v_cmp: Array, *, block: int, top: int, query_chunk: int):
    """The compressed branch (out [B,T,H,D] float32, lse [B,T,H]) and the selected blocks
    [B,K,T',1+top] (``block_sparse.with_own_block``) from one softmax per query: NSA's ranking
    is the group sum of this branch's probabilities (eq. 9-10). Queries in chunks, in runs that
    read only the blocks before their end; flash attention's backward (p recomputed from the
    lse), no gradient through the choice."""
    b, t, h, d = q.shape
    kh = k_cmp.shape[2]
    chunk, t_pad = block_sparse.choice_layout(t, block, query_chunk)
    # float32, zeros past the complete blocks (never visible): as block_sparse ranks by rank_keys
    k_BKND, v_BKND = (jnp.swapaxes(block_sparse._pad_to(x.astype(jnp.float32), t_pad // block), 1, 2) for x in (k_cmp, v_cmp))
    q_BKGTD = block_sparse.grouped_queries(q, kh, t_pad)
    o_BKGTD, lse_BKGT, idx_BKTE = _compressed(q_BKGTD, k_BKND, v_BKND, block, top, chunk)
    o_BTHD = jnp.transpose(o_BKGTD, (0, 3, 1, 2, 4))[:, :t].reshape(b, t, h, d)
    lse_BTH = jnp.transpose(lse_BKGT, (0, 3, 1, 2))[:, :t].reshape(b, t, h)
    return o_BTHD, lse_BTH, block_sparse.with_own_block(idx_BKTE, t, block)


@functools.partial(jax.jit, static_argnames=("block_size", "return_lse", "query_chunk"))
def compressed_attention_xla(q: Array, k_cmp: Array, v_cmp: Array, *, block_size: int, return_lse: bool = False, query_chunk: int = QUERY_CHUNK):
    """NSA's compressed branch alone: [B,T,H,D] in q's dtype (and lse [B,T,H] float32), the
    same program as in [nsa_attention][fibjax.attention.nsa_attention] without the selection."""
    o_BTHD, lse_BTH, _ = _compressed_and_choice(q, k_cmp, v_cmp, block=block_size, top=0, query_chunk=query_chunk)
    o_BTHD = o_BTHD.astype(q.dtype)
    return (o_BTHD, lse_BTH) if return_lse else o_BTHD


def _band_mask(start, rows: int, chunk: int, keys: int, window: int) -> Array:
    """[rows, keys]: row r is the query at start + r % chunk (rows are G groups of a chunk), key j
    the position start - W + j; visible iff within the window and a real position (>= 0)."""
    r_R1 = (jnp.arange(rows) % chunk)[:, None]
    j_1L = jnp.arange(keys)[None, :]
    return (j_1L >= r_R1) & (j_1L <= r_R1 + window) & (j_1L >= window - start)


def _window_forward(q_MBKRD: Array, k_BKPD: Array, v_BKPD: Array, window: int, chunk: int) -> tuple[Array, Array]:
    """Output [M,B,K,R,D] float32 and lse [M,B,K,R] of pre-scaled query chunks (R = G x C rows)
    against keys padded with W zero rows in front (key p at row p + W)."""
    f32 = stats_dtype(q_MBKRD)

    def step(xs):
        q_BKRD, start = xs
        k_BKLD, v_BKLD = (jax.lax.dynamic_slice_in_dim(x, start, chunk + window, axis=2) for x in (k_BKPD, v_BKPD))
        s_BKRL = jnp.einsum("bkrd,bkld->bkrl", q_BKRD, k_BKLD, preferred_element_type=f32)
        s_BKRL = jnp.where(_band_mask(start, s_BKRL.shape[2], chunk, s_BKRL.shape[3], window), s_BKRL, -jnp.inf)
        m_BKR = jnp.max(s_BKRL, axis=-1)  # every query sees itself: finite
        p_BKRL = jnp.exp(s_BKRL - m_BKR[..., None])
        l_BKR = jnp.sum(p_BKRL, axis=-1)
        return jnp.einsum("bkrl,bkld->bkrd", p_BKRL, v_BKLD.astype(f32)) / l_BKR[..., None], m_BKR + jnp.log(l_BKR)

    return jax.lax.map(step, (q_MBKRD, jnp.arange(q_MBKRD.shape[0], dtype=jnp.int32) * chunk))


def _window_fwd(q_MBKRD, k_BKPD, v_BKPD, window, chunk):
    o_MBKRD, lse_MBKR = _window_forward(q_MBKRD, k_BKPD, v_BKPD, window, chunk)
    return o_MBKRD, (q_MBKRD, k_BKPD, v_BKPD, o_MBKRD, lse_MBKR)


def _window_bwd(window, chunk, residuals, do_MBKRD):
    """Flash attention's backward per chunk (p recomputed from the lse); each chunk's dk, dv
    added into the C + W rows it read."""
    q_MBKRD, k_BKPD, v_BKPD, o_MBKRD, lse_MBKR = residuals
    f32 = stats_dtype(q_MBKRD)
    delta_MBKR = jnp.sum(do_MBKRD * o_MBKRD, axis=-1)
    keys = chunk + window

    def step(carry, xs):
        dk_BKPD, dv_BKPD = carry
        q_BKRD, do_BKRD, lse_BKR, delta_BKR, start = xs
        k_BKLD, v_BKLD = (jax.lax.dynamic_slice_in_dim(x, start, keys, axis=2).astype(f32) for x in (k_BKPD, v_BKPD))
        s_BKRL = jnp.einsum("bkrd,bkld->bkrl", q_BKRD, k_BKLD, preferred_element_type=f32)
        p_BKRL = jnp.where(_band_mask(start, s_BKRL.shape[2], chunk, keys, window), jnp.exp(s_BKRL - lse_BKR[..., None]), 0.0)
        ds_BKRL = p_BKRL * (jnp.einsum("bkrd,bkld->bkrl", do_BKRD, v_BKLD) - delta_BKR[..., None])
        dq_BKRD = jnp.einsum("bkrl,bkld->bkrd", ds_BKRL, k_BKLD)
        add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(acc, jax.lax.dynamic_slice_in_dim(acc, start, keys, axis=2) + x, start, axis=2)
        dk_BKPD = add(dk_BKPD, jnp.einsum("bkrl,bkrd->bkld", ds_BKRL, q_BKRD.astype(f32)))
        dv_BKPD = add(dv_BKPD, jnp.einsum("bkrl,bkrd->bkld", p_BKRL, do_BKRD))
        return (dk_BKPD, dv_BKPD), dq_BKRD

    zeros = jnp.zeros(k_BKPD.shape, f32)
    starts_M = jnp.arange(q_MBKRD.shape[0], dtype=jnp.int32) * chunk
    (dk_BKPD, dv_BKPD), dq_MBKRD = jax.lax.scan(step, (zeros, zeros), (q_MBKRD, do_MBKRD, lse_MBKR, delta_MBKR, starts_M))
    return dq_MBKRD.astype(q_MBKRD.dtype), dk_BKPD.astype(k_BKPD.dtype), dv_BKPD.astype(v_BKPD.dtype)


def _window_out(q_MBKRD, k_BKPD, v_BKPD, window, chunk):
    return _window_forward(q_MBKRD, k_BKPD, v_BKPD, window, chunk)[0]


_window = jax.custom_vjp(_window_out, nondiff_argnums=(3, 4))
_window.defvjp(_window_fwd, _window_bwd)


@functools.partial(jax.jit, static_argnames=("window", "query_chunk"))
def window_attention_xla(q: Array, k: Array, v: Array, *, window: int, query_chunk: int = WINDOW_CHUNK):
    """NSA's window branch alone: query i attends keys i - W .. i (W = ``window``) [B,T,H,D].

    Flash attention's arithmetic (``jax.custom_vjp``: the forward keeps the output and lse, the
    backward recomputes p) over a dense band: chunks of ``query_chunk`` queries (``lax.map``),
    each against the C + W keys that reach it, so the work is (C + W) / (W + 1) times the band's."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    c = min(query_chunk, t)
    m = -(-t // c)
    q_BKGTD = jnp.transpose(group_queries(jnp.pad(q, ((0, 0), (0, m * c - t), (0, 0), (0, 0))), kh), (0, 2, 3, 1, 4))
    q_MBKRD = jnp.moveaxis(q_BKGTD.reshape(b, kh, h // kh, m, c, d), 3, 0).reshape(m, b, kh, -1, d)
    # key p at row p + W: the rows before position 0 are zeros the band never reaches
    k_BKPD, v_BKPD = (jnp.transpose(jnp.pad(x, ((0, 0), (window, m * c - t), (0, 0), (0, 0))), (0, 2, 1, 3)) for x in (k, v))
    o_MBKRD = _window(q_MBKRD, k_BKPD, v_BKPD, window, c)
    o_BKGTD = jnp.moveaxis(o_MBKRD.reshape(m, b, kh, h // kh, c, d), 0, 3).reshape(b, kh, h // kh, m * c, d)
    return jnp.transpose(o_BKGTD, (0, 3, 1, 2, 4))[:, :t].reshape(b, t, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "window", "return_lse", "query_chunk", "window_chunk"))
def nsa_attention_xla(
    q: Array,
    k: Array,
    v: Array,
    k_cmp: Array,
    v_cmp: Array,
    gates: Array,
    *,
    block_size: int,
    num_blocks: int,
    window: int,
    return_lse: bool = False,
    query_chunk: int = QUERY_CHUNK,
    window_chunk: int = WINDOW_CHUNK,
):
    """The XLA program behind [nsa_attention][fibjax.attention.nsa_attention] (no argument checks): three branches, each in
    q's dtype, mixed in float32. ``query_chunk``: queries per step of the compressed branch and
    the choice (one softmax serves both); ``window_chunk``: of the window band."""
    top = block_sparse.num_earlier_blocks(q.shape[1], block_size, num_blocks)
    o_cmp, _, idx_BKTS = _compressed_and_choice(q, k_cmp, v_cmp, block=block_size, top=top, query_chunk=query_chunk)
    tiles = dict(pair_tile=block_grouped.TILE, tile_chunk=block_grouped.CHUNK)
    o_slc, lse_slc = block_sparse.attend_blocks(q, k, v, idx_BKTS, block_size=block_size, return_lse=True, **tiles)
    o_win = window_attention_xla(q, k, v, window=window, query_chunk=window_chunk)
    g_BTH3 = gates.astype(jnp.float32)
    o_cmp = o_cmp.astype(q.dtype)  # as the other branches
    out_BTHD = sum(g_BTH3[..., i, None] * o.astype(jnp.float32) for i, o in enumerate((o_cmp, o_slc, o_win)))
    out_BTHD = out_BTHD.astype(q.dtype)
    return (out_BTHD, lse_slc) if return_lse else out_BTHD


def nsa_attention(  # noqa: DOC503
    q: Array, k: Array, v: Array, k_cmp: Array, v_cmp: Array, gates: Array, *, block_size: int, num_blocks: int, window: int, return_lse: bool = False
) -> Array | tuple[Array, Array]:
    """Causal NSA attention (module docstring): gated compressed, selected and window branches.

    q [B,T,H,D], k/v [B,T,K,D] with RoPE applied; k_cmp/v_cmp [B, T // block_size, K, D] the
    compressed blocks ([compress_blocks][fibjax.attention.compress_blocks] of k and v); gates [B,T,H,3] in the order
    (compressed, selected, window). Scale 1/sqrt(D); output in q's dtype. ``return_lse=True``
    adds the *selected* branch's lse [B,T,H] float32: a gated mixture has no single softmax, and
    the selected branch is the one whose key set (a subset of the causal keys) the dropped-mass
    measure of paper B compares with dense attention.

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D].
        v: Values [B,T,K,D].
        k_cmp: Compressed keys [B, T // block_size, K, D].
        v_cmp: Compressed values [B, T // block_size, K, D].
        gates: Branch gates [B,T,H,3] (compressed, selected, window).
        block_size: Keys per block.
        num_blocks: Blocks the selected branch attends, the query's own included.
        window: The window branch's keys per query.
        return_lse: Also return the selected branch's lse [B,T,H] float32.

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: ``window`` not an int >= 0, ``gates`` of the wrong shape, a bad budget or shapes
            that disagree.
    """
    check_qkv(q, k, v)
    check_budget(block_size, num_blocks)
    if not isinstance(window, int | np.integer) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    for name, x in (("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        check_rank_keys(x, k, block_size, name)
    if gates.shape != (*q.shape[:3], len(BRANCHES)):
        raise ValueError(f"gates must be [batch, seq, q_heads, 3] = {(*q.shape[:3], 3)}, got {gates.shape}")
    return nsa_attention_xla(q, k, v, k_cmp, v_cmp, gates, block_size=int(block_size), num_blocks=int(num_blocks), window=int(window), return_lse=return_lse)
