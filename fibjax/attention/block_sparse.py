"""Block-sparse attention (MoBA / NSA-selection style): the sparse stream of SSA, in XLA.

Keys are cut into blocks of ``block_size`` (block b holds positions b*B .. b*B+B-1; the last
block may be ragged). Query i in block c = i // B attends:

* its own block c, causally (keys c*B .. i), always;
* the S-1 earlier blocks b < c that score highest, the score summed over the G query heads that
  share a KV head, so the choice is per (batch, query, KV head). ``block_rank``:
  ``mean_key`` (default, issue 5) scores (sum_g q_{i,g}) . mean(K_b); ``nsa_prob`` (NSA's rule,
  as fla-org/native-sparse-attention) scores sum_g p_{i,g}(b), head g's softmax probability of
  b over the blocks that lie wholly in the query's past, logits q_{i,g} . mean(K_b) / sqrt(D).
  Ties go to the lower block index; with fewer than S-1 earlier blocks, all of them.

then an exact float32 softmax over every key of the selected blocks. S = ``num_blocks``.
NSA (``nsa.py``) reuses this with its compressed keys in place of the block means.

Nothing is [T, T]: queries go in chunks (one ``lax.map`` step each, rematerialised in the
backward); a chunk scores its queries against the T/B block means, keeps the top S-1 with
``lax.top_k`` (which puts equal values at the lower index first), and gathers the S selected
blocks of K and V per query: O(T x S x B x D) for the attention, O(T x T/B x D) for the choice.
Decisions and figures: BUILD_NOTES.md, "Block-sparse attention and passkey".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention.common import Array, check_qkv, finish, masked_softmax, stats_dtype

# Queries per lax.map step: bounds the gathered K/V at chunk x S x B x K x D per batch row.
# 256 beat 512 on CPU in time and memory (BUILD_NOTES); untuned on accelerators.
QUERY_CHUNK = 256


def _pad_to(x_BTKD: Array, t_pad: int) -> Array:
    return jnp.pad(x_BTKD, ((0, 0), (0, t_pad - x_BTKD.shape[1]), (0, 0), (0, 0)))


def _block_sums(k_BTKD: Array, block: int) -> Array:
    """[B,T,K,D] (T a multiple of block) -> [B,N,K,D] float32 key sums per block."""
    b, t, kh, d = k_BTKD.shape
    return jnp.sum(k_BTKD.reshape(b, t // block, block, kh, d).astype(jnp.float32), axis=2)


BLOCK_RANKS = ("mean_key", "nsa_prob")


def _select(q_BCKGD: Array, rank_BNKD: Array, query_start, *, block: int, top: int, rule: str) -> Array:
    """Selected blocks [B,C,K,1+top] int32 for queries query_start + [0, C): slot 0 is the own
    block, then the ``top`` best earlier blocks in descending score; -1 marks an empty slot.
    ``rank_BNKD``: the key standing for each block (``_rank_keys``); q is not yet scaled.

    ``mean_key`` scores q . sum(K_b) rather than q . mean(K_b): every candidate b < c is a full
    block, so the two differ by the constant factor B and rank identically (and the sum is exact
    for dyadic test inputs, which makes ties reproducible)."""
    own_C = (query_start + jnp.arange(q_BCKGD.shape[1])) // block
    own_BCKS = jnp.broadcast_to(own_C[None, :, None, None], (*q_BCKGD.shape[:3], 1)).astype(jnp.int32)
    if top == 0:
        return own_BCKS
    q_BCKGD, rank_BNKD = jax.lax.stop_gradient(q_BCKGD).astype(jnp.float32), jax.lax.stop_gradient(rank_BNKD)
    # full float32 even where TF32 / bf16 passes are the default (GPU, TPU): the choice is discrete
    hi = jax.lax.Precision.HIGHEST
    if rule == "mean_key":
        s_BCKN = jnp.einsum("bckd,bnkd->bckn", jnp.sum(q_BCKGD, axis=3), rank_BNKD, precision=hi)
    else:
        s_BCKGN = jnp.einsum("bckgd,bnkd->bckgn", q_BCKGD, rank_BNKD, precision=hi) / math.sqrt(q_BCKGD.shape[-1])
        # each head's softmax over the blocks wholly in the past (the own one once complete), as NSA's p_cmp
        pos_C = query_start + jnp.arange(q_BCKGD.shape[1])
        past_CN = jnp.arange(rank_BNKD.shape[1])[None, :] < ((pos_C + 1) // block)[:, None]
        p_BCKGN, _ = masked_softmax(s_BCKGN, past_CN[None, :, None, None, :])
        s_BCKN = jnp.sum(p_BCKGN, axis=3)
    earlier_CN = jnp.arange(rank_BNKD.shape[1])[None, :] < own_C[:, None]
    _, idx_BCKS = jax.lax.top_k(jnp.where(earlier_CN[None, :, None, :], s_BCKN, -jnp.inf), top)
    # a slot is filled iff its block is earlier; -inf candidates sort after every real score
    idx_BCKS = jnp.where(idx_BCKS < own_C[None, :, None, None], idx_BCKS, -1).astype(jnp.int32)
    return jnp.concatenate([own_BCKS, idx_BCKS], axis=-1)


def _rank_keys(k_BTKD: Array, rank_keys: Array | None, *, block: int, rule: str) -> Array:
    """[B,N,K,D] float32 (N = T / block, T padded): the given ``rank_keys`` (zeros for the blocks
    past them, never candidates), else the key sums (``mean_key``) or means (``nsa_prob``)."""
    n = k_BTKD.shape[1] // block
    if rank_keys is not None:
        return jnp.pad(rank_keys.astype(jnp.float32), ((0, 0), (0, n - rank_keys.shape[1]), (0, 0), (0, 0)))
    ksum_BNKD = _block_sums(k_BTKD, block)
    return ksum_BNKD if rule == "mean_key" else ksum_BNKD / block


def _gather_blocks(x_BKNJD: Array, idx_BCKS: Array) -> Array:
    """[B,K,N,J,D] by [B,C,K,S] -> [B,K,C,S,J,D] (the backward is a scatter-add)."""
    idx_BKCS = jnp.transpose(jnp.maximum(idx_BCKS, 0), (0, 2, 1, 3))
    return jax.vmap(jax.vmap(lambda x_NJD, i_CS: x_NJD[i_CS]))(x_BKNJD, idx_BKCS)


def _chunk(qraw_BCKGD: Array, k_BKNJD: Array, v_BKNJD: Array, rank_BNKD: Array, query_start, *, block: int, top: int, rule: str):
    """Outputs [B,C,K,G,D] and lse [B,C,K,G] of queries query_start + [0, C) (q not yet scaled)."""
    idx_BCKS = _select(qraw_BCKGD, rank_BNKD, query_start, block=block, top=top, rule=rule)
    # the same rounding as group_queries, so the scores match every other path's
    q_BCKGD = (qraw_BCKGD * (1.0 / math.sqrt(qraw_BCKGD.shape[-1]))).astype(qraw_BCKGD.dtype)
    k_BKCSJD, v_BKCSJD = _gather_blocks(k_BKNJD, idx_BCKS), _gather_blocks(v_BKNJD, idx_BCKS)
    s_BKGCSJ = jnp.einsum("bckgd,bkcsjd->bkgcsj", q_BCKGD, k_BKCSJD, preferred_element_type=stats_dtype(q_BCKGD))
    pos_C = query_start + jnp.arange(q_BCKGD.shape[1])
    key_BCKSJ = idx_BCKS[..., None] * block + jnp.arange(block)
    # filled slot, and causal: only the own block can reach past the query
    valid_BCKSJ = (idx_BCKS[..., None] >= 0) & (key_BCKSJ <= pos_C[None, :, None, None, None])
    valid_BK1CSJ = jnp.transpose(valid_BCKSJ, (0, 2, 1, 3, 4))[:, :, None]
    b, k, g, c, s, j = s_BKGCSJ.shape
    p, lse_BKGC = masked_softmax(s_BKGCSJ.reshape(b, k, g, c, s * j), valid_BK1CSJ.reshape(b, k, 1, c, s * j))
    o_BCKGD = jnp.einsum("bkgcsj,bkcsjd->bckgd", p.reshape(s_BKGCSJ.shape), v_BKCSJD.astype(p.dtype))
    return o_BCKGD, jnp.transpose(lse_BKGC, (0, 3, 1, 2))


def _layout(t: int, block: int, query_chunk: int) -> tuple[int, int]:
    """(queries per chunk, padded length): the chunk is a multiple of the block and divides the length."""
    t_blocks = -(-t // block) * block
    chunk = min(max(1, query_chunk // block) * block, t_blocks)
    return chunk, -(-t // chunk) * chunk


def num_earlier_blocks(t: int, block: int, num_blocks: int) -> int:
    """Slots for earlier blocks at length t: S-1, capped at the most any query can have (N-1)."""
    return min(num_blocks - 1, -(-t // block) - 1)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "return_lse", "query_chunk", "block_rank"))
def block_sparse_attention_xla(
    q: Array,
    k: Array,
    v: Array,
    *,
    block_size: int,
    num_blocks: int,
    return_lse: bool = False,
    query_chunk: int = QUERY_CHUNK,
    block_rank: str = "mean_key",
    rank_keys: Array | None = None,
):
    """The XLA program behind :func:`block_sparse_attention` (no argument checks). ``rank_keys``
    [B, N', K, D] (N' <= T // block_size, NSA's compressed keys) replace the block means in the ranking."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    chunk, t_pad = _layout(t, block_size, query_chunk)
    top = num_earlier_blocks(t, block_size, num_blocks)
    # padded keys sit after every real query, so the causal mask hides them; padded queries are dropped
    q, k, v = (_pad_to(x, t_pad) for x in (q, k, v))
    q_BTKGD = q.reshape(b, t_pad, kh, h // kh, d)
    n = t_pad // block_size
    k_BKNJD, v_BKNJD = (jnp.transpose(x.reshape(b, n, block_size, kh, d), (0, 3, 1, 2, 4)) for x in (k, v))
    rank_BNKD = _rank_keys(k, rank_keys, block=block_size, rule=block_rank)
    body = functools.partial(_chunk, block=block_size, top=top, rule=block_rank)
    if t_pad == chunk:
        o_BTKGD, lse_BTKG = body(q_BTKGD, k_BKNJD, v_BKNJD, rank_BNKD, 0)
    else:
        m = t_pad // chunk
        q_MBCKGD = jnp.moveaxis(q_BTKGD.reshape(b, m, chunk, *q_BTKGD.shape[2:]), 1, 0)
        step = jax.checkpoint(lambda xs: body(xs[0], k_BKNJD, v_BKNJD, rank_BNKD, xs[1]))
        o_M, lse_M = jax.lax.map(step, (q_MBCKGD, jnp.arange(m, dtype=jnp.int32) * chunk))
        o_BTKGD = jnp.moveaxis(o_M, 0, 1).reshape(b, t_pad, *q_BTKGD.shape[2:])
        lse_BTKG = jnp.moveaxis(lse_M, 0, 1).reshape(b, t_pad, *q_BTKGD.shape[2:4])
    return finish(o_BTKGD, lse_BTKG, q[:, :t], return_lse)


def check_budget(block_size, num_blocks, block_rank: str = "mean_key") -> None:
    for name, x in (("block_size", block_size), ("num_blocks", num_blocks)):
        if not isinstance(x, int | np.integer) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    if block_rank not in BLOCK_RANKS:
        raise ValueError(f"block_rank must be one of {BLOCK_RANKS}, got {block_rank!r}")


def check_rank_keys(rank_keys: Array, k: Array, block_size: int, name: str = "rank_keys") -> None:
    want = (k.shape[0], k.shape[1] // block_size, *k.shape[2:])
    if rank_keys.shape != want:
        raise ValueError(f"{name} must be [batch, seq // block_size, kv_heads, head_dim] = {want}, got {rank_keys.shape}")


def block_sparse_attention(q: Array, k: Array, v: Array, *, block_size: int, num_blocks: int, block_rank: str = "mean_key", return_lse: bool = False):
    """Causal block-sparse attention: each query attends its own block (up to itself) and the
    ``num_blocks - 1`` earlier blocks of ``block_size`` keys that rank highest by ``block_rank``
    (module docstring: the group-summed q . mean key, or NSA's group-summed per-head softmax
    probability; ties to the lower block).

    q [B,T,H,D], k/v [B,T,K,D] with RoPE applied; scale 1/sqrt(D); output in q's dtype, and
    lse [B,T,H] float32 with ``return_lse=True``. ``num_blocks >= ceil(T / block_size)`` is
    dense causal attention.
    """
    check_qkv(q, k, v)
    check_budget(block_size, num_blocks, block_rank)
    return block_sparse_attention_xla(q, k, v, block_size=int(block_size), num_blocks=int(num_blocks), return_lse=return_lse, block_rank=block_rank)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "block_rank"))
def _select_all(q: Array, k: Array, rank_keys: Array | None, *, block_size: int, num_blocks: int, block_rank: str) -> Array:
    b, t, h, d = q.shape
    _, t_pad = _layout(t, block_size, t)
    q, k = _pad_to(q, t_pad), _pad_to(k, t_pad)
    idx = _select(
        q.reshape(b, t_pad, k.shape[2], h // k.shape[2], d),
        _rank_keys(k, rank_keys, block=block_size, rule=block_rank),
        0,
        block=block_size,
        top=num_earlier_blocks(t, block_size, num_blocks),
        rule=block_rank,
    )
    return idx[:, :t]


def select_blocks(q: Array, k: Array, *, block_size: int, num_blocks: int, block_rank: str = "mean_key", rank_keys: Array | None = None) -> Array:
    """The blocks each (batch, query, KV head) attends: int32 [B,T,K,S'], S' = min(S, ceil(T/B)).

    Slot 0 is the query's own block; then the chosen earlier blocks, best score first (equal
    scores: lower block first); -1 fills slots a query cannot use (fewer earlier blocks than S-1).
    The same choice :func:`block_sparse_attention` makes; ``rank_keys`` [B, T // B, K, D] stand
    for the blocks instead of their means (NSA's compressed keys).
    """
    check_qkv(q, k, k)
    check_budget(block_size, num_blocks, block_rank)
    if rank_keys is not None:
        check_rank_keys(rank_keys, k, block_size)
    return _select_all(q, k, rank_keys, block_size=int(block_size), num_blocks=int(num_blocks), block_rank=block_rank)


def dropped_mass(lse_sparse: Array, lse_full: Array, axis=None) -> Array:
    """Softmax mass full attention puts on keys a sparse pattern skips, 1 - exp(lse_sparse -
    lse_full), averaged over ``axis`` (None: every element), float32.

    Valid when the sparse key set is a subset of the full one (then lse_sparse <= lse_full; the
    difference is clipped at 0 against rounding, so the result lies in [0, 1]). A row whose full
    set is empty (lse_full = -inf) drops nothing; a sparse row with no key drops everything.
    """
    lse_sparse, lse_full = jnp.asarray(lse_sparse, jnp.float32), jnp.asarray(lse_full, jnp.float32)
    finite = jnp.isfinite(lse_full)
    diff = jnp.minimum(lse_sparse - jnp.where(finite, lse_full, 0.0), 0.0)
    per_row = jnp.where(finite, -jnp.expm1(diff), 0.0)
    return jnp.mean(per_row, axis=axis)
