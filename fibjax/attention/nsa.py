"""NSA (Native Sparse Attention, Yuan et al. 2025) in XLA: paper B's gated three-branch baseline.

Query i (RoPE'd q, k, v shared by the branches) mixes three attentions with its own per-head
gates g [B,T,H,3] in [0, 1] (sigmoids the model computes from the layer input):

    o_i = g_cmp o_cmp + g_slc o_slc + g_win o_win

* compressed: softmax over the compressed blocks k_cmp[n], v_cmp[n] (one key and value per block
  of B = ``block_size`` keys, from :func:`compress_blocks`) that lie wholly in the query's past,
  (n + 1) B - 1 <= i; a query before the end of block 0 sees none and o_cmp = 0;
* selected: its own block (causally) and the S-1 earlier blocks (S = ``num_blocks``) with the
  largest sum over the G query heads of its KV group of that head's compressed-branch softmax
  probability (NSA eq. 9-10; ``block_sparse`` with ``block_rank="nsa_prob"`` and k_cmp as the
  block keys; no gradient through the choice; ties to the lower block);
* window: keys i - W .. i (W = ``window``, the repo's window {0..W}: W + 1 keys).

Compression and selection share one blocking (block length = stride = selection block), as the
reference code (fla-org/native-sparse-attention, used by paper B) does. Decisions and deviations
from the NSA paper: BUILD_NOTES.md, "NSA".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention.block_sparse import QUERY_CHUNK, block_sparse_attention_xla, check_budget, check_rank_keys
from fibjax.attention.common import Array, check_qkv, finish, group_queries, masked_softmax, stats_dtype

BRANCHES = ("cmp", "slc", "win")  # the order of the gates' last axis


def compress_blocks(x_BTKD: Array, pos_JD: Array, w_in_XF: Array, w_out_FD: Array) -> Array:
    """NSA's learned block compression phi, per KV head (weights shared by the heads):

        phi(X_n) = mean_j x_{nJ+j} + relu(vec(X_n + P) W_in) W_out,   X_n = x_{nJ} .. x_{nJ+J-1}

    [B,T,K,D] -> [B,N,K,D] over the N = T // J complete blocks (J = pos rows; P the intra-block
    position embedding [J, D], W_in [J*D, F], W_out [F, D]). The mean is the reference code's
    whole compression; the MLP is the paper's learned phi, added on top so that W_out = 0 (the
    model's initialisation) is exactly the reference. Computed in x's dtype, the mean in float32."""
    b, t, kh, d = x_BTKD.shape
    j = pos_JD.shape[0]
    n = t // j
    x_BNJKD = x_BTKD[:, : n * j].reshape(b, n, j, kh, d)
    mean_BNKD = jnp.mean(x_BNJKD.astype(jnp.float32), axis=2)
    z_BNKX = jnp.moveaxis(x_BNJKD + pos_JD[:, None, :], 2, 3).reshape(b, n, kh, j * d)
    mlp_BNKD = jax.nn.relu(z_BNKX @ w_in_XF) @ w_out_FD
    return (mean_BNKD + mlp_BNKD.astype(jnp.float32)).astype(x_BTKD.dtype)


def _compressed_chunk(q_BCKGD: Array, k_BNKD: Array, v_BNKD: Array, query_start, *, block: int):
    """Queries query_start + [0, C) (pre-scaled) against the blocks wholly in their past."""
    pos_C = query_start + jnp.arange(q_BCKGD.shape[1])
    past_CN = (jnp.arange(k_BNKD.shape[1])[None, :] + 1) * block - 1 <= pos_C[:, None]
    s_BKGCN = jnp.einsum("bckgd,bnkd->bkgcn", q_BCKGD, k_BNKD, preferred_element_type=stats_dtype(q_BCKGD))
    p_BKGCN, lse_BKGC = masked_softmax(s_BKGCN, past_CN)
    o_BCKGD = jnp.einsum("bkgcn,bnkd->bckgd", p_BKGCN, v_BNKD.astype(p_BKGCN.dtype))
    return o_BCKGD, jnp.transpose(lse_BKGC, (0, 3, 1, 2))


@functools.partial(jax.jit, static_argnames=("block_size", "return_lse", "query_chunk"))
def compressed_attention_xla(q: Array, k_cmp: Array, v_cmp: Array, *, block_size: int, return_lse: bool = False, query_chunk: int = QUERY_CHUNK):
    """NSA's compressed branch alone: [B,T,H,D] (and lse [B,T,H]); queries in chunks of
    ``query_chunk`` (``lax.map``, rematerialised), so the scores are at most chunk x T / B."""
    b, t, h, d = q.shape
    kh, n = k_cmp.shape[2], k_cmp.shape[1]
    q_BTKGD = group_queries(q, kh)
    if n == 0:  # shorter than one block: no query has a compressed block
        return finish(jnp.zeros(q_BTKGD.shape, jnp.float32), jnp.full(q_BTKGD.shape[:4], -jnp.inf), q, return_lse)
    body = functools.partial(_compressed_chunk, block=block_size)
    if t <= query_chunk:
        o_BTKGD, lse_BTKG = body(q_BTKGD, k_cmp, v_cmp, 0)
    else:
        m = -(-t // query_chunk)
        q_pad = jnp.pad(q_BTKGD, ((0, 0), (0, m * query_chunk - t), (0, 0), (0, 0), (0, 0)))
        q_MBCKGD = jnp.moveaxis(q_pad.reshape(b, m, query_chunk, *q_BTKGD.shape[2:]), 1, 0)
        step = jax.checkpoint(lambda xs: body(xs[0], k_cmp, v_cmp, xs[1]))
        o_M, lse_M = jax.lax.map(step, (q_MBCKGD, jnp.arange(m, dtype=jnp.int32) * query_chunk))
        o_BTKGD = jnp.moveaxis(o_M, 0, 1).reshape(b, m * query_chunk, *q_BTKGD.shape[2:])
        lse_BTKG = jnp.moveaxis(lse_M, 0, 1).reshape(b, m * query_chunk, *q_BTKGD.shape[2:4])
    return finish(o_BTKGD, lse_BTKG, q, return_lse)


def _window_chunk(q_BKGCD: Array, k_BKLD: Array, v_BKLD: Array, query_start, *, window: int):
    """Queries query_start + [0, C) (pre-scaled) against keys query_start - W + [0, C + W)."""
    pos_C = query_start + jnp.arange(q_BKGCD.shape[3])
    key_L = query_start - window + jnp.arange(k_BKLD.shape[2])
    band_CL = (key_L[None, :] <= pos_C[:, None]) & (key_L[None, :] >= jnp.maximum(pos_C[:, None] - window, 0))
    s_BKGCL = jnp.einsum("bkgcd,bkld->bkgcl", q_BKGCD, k_BKLD, preferred_element_type=stats_dtype(q_BKGCD))
    p_BKGCL, _ = masked_softmax(s_BKGCL, band_CL)
    return jnp.einsum("bkgcl,bkld->bkgcd", p_BKGCL, v_BKLD.astype(p_BKGCL.dtype))


@functools.partial(jax.jit, static_argnames=("window", "query_chunk"))
def window_attention_xla(q: Array, k: Array, v: Array, *, window: int, query_chunk: int = QUERY_CHUNK):
    """NSA's window branch alone: query i attends keys i - W .. i (W = ``window``) [B,T,H,D].

    A dense band in chunks of ``query_chunk`` queries (``lax.map``, rematerialised), each against
    the C + W keys that reach it: about (C + W) / (W + 1) times the band's work, in plain matmuls
    (several times faster on CPU than ``offset_attention`` with W + 1 distances)."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    c = min(query_chunk, t)
    m = -(-t // c)
    q_BKGTD = jnp.transpose(group_queries(jnp.pad(q, ((0, 0), (0, m * c - t), (0, 0), (0, 0))), kh), (0, 2, 3, 1, 4))
    # key p at row p + W: the rows before position 0 are zeros the band never reaches
    k_BKLD, v_BKLD = (jnp.transpose(jnp.pad(x, ((0, 0), (window, m * c - t), (0, 0), (0, 0))), (0, 2, 1, 3)) for x in (k, v))
    body = functools.partial(_window_chunk, window=window)
    if m == 1:
        o_BKGTD = body(q_BKGTD, k_BKLD, v_BKLD, 0)
    else:
        q_MBKGCD = jnp.moveaxis(q_BKGTD.reshape(*q_BKGTD.shape[:3], m, c, d), 3, 0)

        def step(xs):
            q_BKGCD, start = xs
            k_BKLD_, v_BKLD_ = (jax.lax.dynamic_slice_in_dim(x, start, c + window, axis=2) for x in (k_BKLD, v_BKLD))
            return body(q_BKGCD, k_BKLD_, v_BKLD_, start)

        o_M = jax.lax.map(jax.checkpoint(step), (q_MBKGCD, jnp.arange(m, dtype=jnp.int32) * c))
        o_BKGTD = jnp.moveaxis(o_M, 0, 3).reshape(*q_BKGTD.shape)
    return jnp.transpose(o_BKGTD, (0, 3, 1, 2, 4))[:, :t].reshape(b, t, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "window", "return_lse", "query_chunk"))
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
):
    """The XLA program behind :func:`nsa_attention` (no argument checks): three branches, each in
    q's dtype, mixed in float32."""
    o_cmp = compressed_attention_xla(q, k_cmp, v_cmp, block_size=block_size, query_chunk=query_chunk)
    o_slc, lse_slc = block_sparse_attention_xla(
        q, k, v, block_size=block_size, num_blocks=num_blocks, return_lse=True, query_chunk=query_chunk, block_rank="nsa_prob", rank_keys=k_cmp
    )
    o_win = window_attention_xla(q, k, v, window=window, query_chunk=query_chunk)
    g_BTH3 = gates.astype(jnp.float32)
    out_BTHD = sum(g_BTH3[..., i, None] * o.astype(jnp.float32) for i, o in enumerate((o_cmp, o_slc, o_win)))
    out_BTHD = out_BTHD.astype(q.dtype)
    return (out_BTHD, lse_slc) if return_lse else out_BTHD


def nsa_attention(
    q: Array, k: Array, v: Array, k_cmp: Array, v_cmp: Array, gates: Array, *, block_size: int, num_blocks: int, window: int, return_lse: bool = False
):
    """Causal NSA attention (module docstring): gated compressed, selected and window branches.

    q [B,T,H,D], k/v [B,T,K,D] with RoPE applied; k_cmp/v_cmp [B, T // block_size, K, D] the
    compressed blocks (:func:`compress_blocks` of k and v); gates [B,T,H,3] in the order
    (compressed, selected, window). Scale 1/sqrt(D); output in q's dtype. ``return_lse=True``
    adds the *selected* branch's lse [B,T,H] float32: a gated mixture has no single softmax, and
    the selected branch is the one whose key set (a subset of the causal keys) the dropped-mass
    measure of paper B compares with dense attention.
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
