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
NSA (``nsa.py``) reuses the choice's pieces (``group_probabilities``, ``top_earlier``, ``in_runs``)
with its compressed keys in place of the block means, and ``attend_blocks``.

Nothing is [T, T]. The choice: queries in chunks (one ``lax.map`` step each), a chunk scoring its
queries against the block means and keeping the top S-1 with ``lax.top_k`` (which puts equal
values at the lower index first); chunks go in runs that read only the blocks before the run's
end (about 9/16 of a [T, T/B] product). The attention: ``block_grouped``, the (query, block)
pairs grouped by block, so its cost follows the S x B keys a query reads. O(T x S x D) memory
traffic for the attention, O(T x T/B x D) arithmetic for the choice.
Decisions and figures: BUILD_NOTES.md, "Block-sparse (MoBA)".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention import block_grouped
from fibjax.attention.common import Array, check_qkv, finish, group_queries, masked_softmax

# Queries per lax.map step of the choice: bounds its scores at chunk x T/B per KV head.
QUERY_CHUNK = 256
# Runs of chunks, each reading the blocks up to its end (as dense.KEY_SEGMENTS)
RANK_SEGMENTS = 8

BLOCK_RANKS = ("mean_key", "nsa_prob")


def _pad_to(x_BTKD: Array, t_pad: int) -> Array:
    return jnp.pad(x_BTKD, ((0, 0), (0, t_pad - x_BTKD.shape[1]), (0, 0), (0, 0)))


def _block_sums(k_BTKD: Array, block: int) -> Array:
    """[B,T,K,D] (T a multiple of block) -> [B,N,K,D] float32 key sums per block."""
    b, t, kh, d = k_BTKD.shape
    return jnp.sum(k_BTKD.reshape(b, t // block, block, kh, d).astype(jnp.float32), axis=2)


def group_probabilities(q_BKGCD: Array, rank_BKND: Array, query_start, *, block: int) -> Array:
    """NSA's p_cmp: each head's softmax [B,K,G,C,N] over the blocks wholly in the past (the own
    one once complete) of logits q . rank / sqrt(D), in float32 at full precision (the choice is
    discrete: no TF32 / bf16 passes), and the log-sum-exp [B,K,G,C]. Differentiable: the
    compressed branch attends with the same probabilities."""
    c, d = q_BKGCD.shape[3:]
    hi = jax.lax.Precision.HIGHEST
    s_BKGCN = jnp.einsum("bkgcd,bknd->bkgcn", q_BKGCD.astype(jnp.float32), rank_BKND, precision=hi) / math.sqrt(d)
    past_CN = jnp.arange(rank_BKND.shape[2])[None, :] < ((query_start + jnp.arange(c) + 1) // block)[:, None]
    return masked_softmax(s_BKGCN, past_CN)


def top_earlier(s_BKCN: Array, query_start, *, block: int, top: int) -> Array:
    """The ``top`` best-scoring earlier blocks [B,K,C,top] int32 of queries query_start + [0, C),
    in descending score (equal scores: the lower block first, as ``lax.top_k`` orders them);
    -1 marks an empty slot."""
    c, n = s_BKCN.shape[2:]
    own_C = (query_start + jnp.arange(c)) // block
    earlier_CN = jnp.arange(n)[None, :] < own_C[:, None]
    _, idx_BKCE = jax.lax.top_k(jnp.where(earlier_CN, s_BKCN, -jnp.inf), min(top, n))
    # a slot is filled iff its block is earlier; -inf candidates sort after every real score
    idx_BKCE = jnp.where(idx_BKCE < own_C[:, None], idx_BKCE, -1).astype(jnp.int32)
    return jnp.pad(idx_BKCE, ((0, 0), (0, 0), (0, 0), (0, top - idx_BKCE.shape[-1])), constant_values=-1)


def _select(q_BKGCD: Array, rank_BKND: Array, query_start, *, block: int, top: int, rule: str) -> Array:
    """The ``top`` best earlier blocks [B,K,C,top] (``top_earlier``) of queries query_start + [0, C).
    ``rank_BKND``: the key standing for each block (``_rank_keys``), at least the blocks before
    the chunk's end; q is not yet scaled.

    ``mean_key`` scores q . sum(K_b) rather than q . mean(K_b): every candidate b < c is a full
    block, so the two differ by the constant factor B and rank identically (and the sum is exact
    for dyadic test inputs, which makes ties reproducible)."""
    q_BKGCD, rank_BKND = jax.lax.stop_gradient(q_BKGCD).astype(jnp.float32), jax.lax.stop_gradient(rank_BKND)
    if rule == "mean_key":
        # full float32 even where TF32 / bf16 passes are the default (GPU, TPU): the choice is discrete
        s_BKCN = jnp.einsum("bkcd,bknd->bkcn", jnp.sum(q_BKGCD, axis=2), rank_BKND, precision=jax.lax.Precision.HIGHEST)
    else:
        s_BKCN = jnp.sum(group_probabilities(q_BKGCD, rank_BKND, query_start, block=block)[0], axis=2)
    return top_earlier(s_BKCN, query_start, block=block, top=top)


def _rank_keys(k_BTKD: Array, rank_keys: Array | None, *, block: int, rule: str) -> Array:
    """[B,K,N,D] float32 (N = T / block, T padded): the given ``rank_keys`` (zeros for the blocks
    past them, never candidates), else the key sums (``mean_key``) or means (``nsa_prob``)."""
    n = k_BTKD.shape[1] // block
    if rank_keys is not None:
        rank_BNKD = jnp.pad(rank_keys.astype(jnp.float32), ((0, 0), (0, n - rank_keys.shape[1]), (0, 0), (0, 0)))
    else:
        rank_BNKD = _block_sums(k_BTKD, block) / (1 if rule == "mean_key" else block)
    return jnp.swapaxes(rank_BNKD, 1, 2)


def run_bounds(t: int, chunk: int) -> list[tuple[int, int]]:
    """The query ranges [s, e) of ``in_runs``: RANK_SEGMENTS runs of whole chunks, as even as whole
    chunks allow (T a multiple of ``chunk``)."""
    m = t // chunk
    runs = min(RANK_SEGMENTS, m)
    bounds = [round(i * m / runs) * chunk for i in range(runs + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def in_runs(fn, q_BKGTD: Array, blocks: tuple[Array, ...], *, block: int, chunk: int, axes: tuple[int, ...]) -> tuple[Array, ...]:
    """``fn(q_BKGCD, *blocks_seg, query_start)`` over chunks of queries (T a multiple of ``chunk``,
    a multiple of ``block``), in runs that each read only the blocks [B,K,N,D] before the run's
    end; fn's outputs joined along their query axes ``axes``."""
    parts = []
    for s, e in run_bounds(q_BKGTD.shape[3], chunk):
        seg = tuple(x[:, :, : e // block] for x in blocks)
        if e - s == chunk:
            parts.append(fn(q_BKGTD[:, :, :, s:e], *seg, s))
            continue
        out_M = jax.lax.map(lambda xs, seg=seg: fn(xs[0], *seg, xs[1]), (split_chunks(q_BKGTD, s, e, chunk), chunk_starts(s, e, chunk)))
        parts.append(tuple(merge_chunks(x, a) for x, a in zip(out_M, axes)))
    return tuple(jnp.concatenate(xs, axis=a) for xs, a in zip(zip(*parts), axes))


def split_chunks(x_BKGT_: Array, start: int, stop: int, chunk: int) -> Array:
    """Queries [start, stop) (whole chunks) with the chunks as a leading axis:
    [B, K, G, T, ...] -> [M, B, K, G, C, ...]."""
    y = x_BKGT_[:, :, :, start:stop]
    return jnp.moveaxis(y.reshape(*y.shape[:3], (stop - start) // chunk, chunk, *y.shape[4:]), 3, 0)


def chunk_starts(start: int, stop: int, chunk: int) -> Array:
    """[M] int32: the first query of each chunk of [start, stop)."""
    return start + chunk * jnp.arange((stop - start) // chunk, dtype=jnp.int32)


def merge_chunks(x_M_: Array, axis: int) -> Array:
    """[M, ..., C (at ``axis`` of a chunk's output), ...] -> [..., M x C, ...]."""
    y = jnp.moveaxis(x_M_, 0, axis)
    return y.reshape(*y.shape[:axis], y.shape[axis] * y.shape[axis + 1], *y.shape[axis + 2 :])


def choice_layout(t: int, block: int, query_chunk: int) -> tuple[int, int]:
    """(queries per chunk of the choice, padded length): the chunk is a multiple of the block
    and divides the length."""
    t_blocks = -(-t // block) * block
    chunk = min(max(1, query_chunk // block) * block, t_blocks)
    return chunk, -(-t // chunk) * chunk


def num_earlier_blocks(t: int, block: int, num_blocks: int) -> int:
    """Slots for earlier blocks at length t: S-1, capped at the most any query can have (N-1)."""
    return min(num_blocks - 1, -(-t // block) - 1)


def grouped_queries(q: Array, kv_heads: int, t_pad: int) -> Array:
    """[B,T,H,D] -> [B,K,G,T',D] unscaled, padded to t_pad (the choice's layout)."""
    b, _, h, d = q.shape
    return jnp.transpose(_pad_to(q, t_pad).reshape(b, t_pad, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))


def with_own_block(idx_BKTE: Array, t: int, block: int) -> Array:
    """[B,K,T',1+top] (T' = T rounded up to ``block``): slot 0 the query's own block, then the
    choice ``idx_BKTE`` (at least T' queries); the padded queries choose nothing."""
    b, kh = idx_BKTE.shape[:2]
    t_blocks = -(-t // block) * block
    idx_BKTE = jnp.where((jnp.arange(t_blocks) < t)[:, None], idx_BKTE[:, :, :t_blocks], -1)
    own_BKT1 = jnp.broadcast_to((jnp.arange(t_blocks, dtype=jnp.int32) // block)[:, None], (b, kh, t_blocks, 1))
    return jnp.concatenate([own_BKT1, idx_BKTE], axis=-1)


def _chosen_blocks(q: Array, k: Array, rank_keys: Array | None, *, block: int, top: int, rule: str, chunk: int) -> Array:
    """[B,K,T',1+top] for q [B,T,H,D], k [B,T,K,D] (``with_own_block``)."""
    chunk, t_pad = choice_layout(q.shape[1], block, chunk)
    rank_BKND = _rank_keys(_pad_to(k, t_pad), rank_keys, block=block, rule=rule)
    q_BKGTD = grouped_queries(q, k.shape[2], t_pad)
    select = functools.partial(_select, block=block, top=top, rule=rule)
    (idx_BKTE,) = in_runs(lambda q_, r_, start: (select(q_, r_, start),), q_BKGTD, (rank_BKND,), block=block, chunk=chunk, axes=(2,))
    return with_own_block(idx_BKTE, q.shape[1], block)


def attend_layout(q: Array, k: Array, v: Array, idx_BKTS: Array, *, block_size: int, pair_tile: int, tile_chunk: int):
    """``attend_blocks``' first stage: q [B,T',K,G,D] pre-scaled, k, v [B,T',K,D] (T' = T in whole
    blocks) and the tiles of the pairs (``block_grouped.pair_layout``)."""
    t_blocks, kh = idx_BKTS.shape[2], k.shape[2]
    # padded keys sit after every real query, so the causal mask hides them; padded queries are dropped
    q, k, v = (_pad_to(x, t_blocks) for x in (q, k, v))
    layout = block_grouped.pair_layout(idx_BKTS, t_blocks // block_size, tile=pair_tile, chunk=tile_chunk)
    return group_queries(q, kh), k, v, layout  # the same rounding as every other path's


def attend_blocks(q: Array, k: Array, v: Array, idx_BKTS: Array, *, block_size: int, return_lse: bool, pair_tile: int, tile_chunk: int):
    """Causal softmax attention of each query over its blocks ``idx_BKTS`` (``with_own_block``):
    layout, the grouped attention, ``finish`` (the stages ``fibjax.bench.phases`` times)."""
    q_BTKGD, k, v, layout = attend_layout(q, k, v, idx_BKTS, block_size=block_size, pair_tile=pair_tile, tile_chunk=tile_chunk)
    o_BTKGD, lse_BTKG = block_grouped.grouped_attention(q_BTKGD, k, v, layout, block_size, pair_tile, tile_chunk)
    return finish(o_BTKGD, lse_BTKG, q, return_lse)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "return_lse", "query_chunk", "block_rank", "pair_tile", "tile_chunk"))
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
    pair_tile: int = block_grouped.TILE,
    tile_chunk: int = block_grouped.CHUNK,
):
    """The XLA program behind [block_sparse_attention][fibjax.attention.block_sparse_attention] (no argument checks). ``rank_keys``
    [B, N', K, D] (N' <= T // block_size, NSA's compressed keys) replace the block means in the
    ranking. ``query_chunk``: queries per step of the choice; ``pair_tile``, ``tile_chunk``: the
    attention's tiles (``block_grouped``)."""
    top = num_earlier_blocks(q.shape[1], block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, rank_keys, block=block_size, top=top, rule=block_rank, chunk=query_chunk)
    return attend_blocks(q, k, v, idx_BKTS, block_size=block_size, return_lse=return_lse, pair_tile=pair_tile, tile_chunk=tile_chunk)


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


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "block_rank"))
def _select_all(q: Array, k: Array, rank_keys: Array | None, *, block_size: int, num_blocks: int, block_rank: str) -> Array:
    t = q.shape[1]
    top = num_earlier_blocks(t, block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, rank_keys, block=block_size, top=top, rule=block_rank, chunk=QUERY_CHUNK)
    return jnp.swapaxes(idx_BKTS, 1, 2)[:, :t]


def select_blocks(  # noqa: DOC502
    q: Array, k: Array, *, block_size: int, num_blocks: int, block_rank: str = "mean_key", rank_keys: Array | None = None
) -> Array:
    """The blocks each (batch, query, KV head) attends: int32 [B,T,K,S'], S' = min(S, ceil(T/B)).

    Slot 0 is the query's own block; then the chosen earlier blocks, best score first (equal
    scores: lower block first); -1 fills slots a query cannot use (fewer earlier blocks than S-1).
    The same choice [block_sparse_attention][fibjax.attention.block_sparse_attention] makes; ``rank_keys`` [B, T // B, K, D] stand
    for the blocks instead of their means (NSA's compressed keys).

    Args:
        q: Queries [B,T,H,D].
        k: Keys [B,T,K,D].
        block_size: Keys per block.
        num_blocks: S, the blocks each query attends, its own included.
        block_rank: How blocks are ranked (``BLOCK_RANKS``).
        rank_keys: Optional keys [B, T // B, K, D] that stand for the blocks.

    Returns:
        The block indices, int32 [B,T,K,S'].

    Raises:
        ValueError: A bad budget, ``block_rank`` or ``rank_keys`` shape.
    """
    check_qkv(q, k, k)
    check_budget(block_size, num_blocks, block_rank)
    if rank_keys is not None:
        check_rank_keys(rank_keys, k, block_size)
    return _select_all(q, k, rank_keys, block_size=int(block_size), num_blocks=int(num_blocks), block_rank=block_rank)


def dropped_mass(lse_sparse: Array, lse_full: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """Softmax mass full attention puts on keys a sparse pattern skips, 1 - exp(lse_sparse -
    lse_full), averaged over ``axis`` (None: every element), float32.

    Valid when the sparse key set is a subset of the full one (then lse_sparse <= lse_full; the
    difference is clipped at 0 against rounding, so the result lies in [0, 1]). A row whose full
    set is empty (lse_full = -inf) drops nothing; a sparse row with no key drops everything.

    Args:
        lse_sparse: The sparse pattern's log-sum-exp (``return_lse=True``).
        lse_full: Full attention's log-sum-exp, same shape.
        axis: The axes to average over (None: all).

    Returns:
        The dropped mass in [0, 1], float32.
    """
    lse_sparse, lse_full = jnp.asarray(lse_sparse, jnp.float32), jnp.asarray(lse_full, jnp.float32)
    finite = jnp.isfinite(lse_full)
    diff = jnp.minimum(lse_sparse - jnp.where(finite, lse_full, 0.0), 0.0)
    per_row = jnp.where(finite, -jnp.expm1(diff), 0.0)
    return jnp.mean(per_row, axis=axis)
