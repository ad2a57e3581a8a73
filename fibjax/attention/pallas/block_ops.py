"""Block-sparse attention on Pallas tile kernels: the tile map, the layout, the LSE merge, the custom VJP.

Same semantics, arguments and return values as ``block_sparse.block_sparse_attention_xla``. The
choice is the same XLA code (``block_sparse._chosen_blocks``: chunks of queries, each keeping its
top blocks, never the [T, T/B] scores). The kernels (``block_kernels``) attend tiles of queries
that chose one block:

1. **tile map** (``tile_map``, once a step, shared by the forward and the backward): per (batch,
   KV head), the (query, block) pairs sorted by block and cut into tiles of R query rows
   (``block_grouped.pair_layout``: a sort and cumulative sums). A block chosen by c queries fills
   ceil(c / R) tiles, only the last one part-filled, so the padding is at most R - 1 rows a block.
   The tile count is static: X = ceil(T S / R) + N >= sum over blocks of ceil(c_n / R), since the
   c_n add up to at most T S. Tiles past the ones a choice fills hold only padding. With it comes
   the forward index: each (query, slot)'s row in the tiles.
2. **forward**: the tiles' query rows gathered in XLA, one program per tile giving each row's
   partial (o, lse) over its block, then the **LSE merge** per query over its S partials, which is
   exact: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) o_s.
3. **backward**: flash attention's, from the merged lse. One program per tile writes the tile's
   dq rows and its block's dk, dv; XLA sums the dq rows per query (through the forward index) and
   the dk, dv partials per block (a segment sum over the block-sorted tiles). delta = rowsum(do *
   out) - d lse, so a cotangent on the returned lse is exact too.

Each stage is a named function (``fwd_layout``, ``fwd_kernels``, ``fwd_merge``, ``bwd_layout``,
``bwd_kernels``, ``bwd_merge``), so ``fibjax.bench.phases`` times the functions the path runs.
Letters: X tiles, R query rows a tile, L = R G kernel rows, S slots, N blocks of J keys.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax.attention import block_grouped
from fibjax.attention.block_sparse import _chosen_blocks, _pad_to, num_earlier_blocks
from fibjax.attention.common import Array
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas import block_kernels
from fibjax.attention.pallas.kernels import MIN_DOT


class _Spec(NamedTuple):
    """Everything static about one call (hashable: a ``nondiff_argnums`` argument)."""

    block: int  # keys per block (J)
    seq_len: int
    block_sizes: be.BlockSizes  # block_q: query rows per tile (R)
    backend: str

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block)

    @property
    def padded_len(self) -> int:
        """T in whole key blocks."""
        return self.num_blocks * self.block

    @property
    def rows(self) -> int:
        """R; at least 16 on Triton (its dot wants every side >= 16)."""
        return max(self.block_sizes.block_q, MIN_DOT) if self.backend == "triton" else self.block_sizes.block_q

    def kwargs(self) -> dict:
        return dict(block=self.block, backend=self.backend, block_sizes=self.block_sizes)


class TileMap(NamedTuple):
    """The choice inverted, per (batch, KV head): int32, no gradient. X tiles of R query rows."""

    rows: Array  # [B, K, X, R] each tile row's query position, -1 for padding
    blocks: Array  # [B K X] each tile's key block, sorted within a (batch, KV head)
    index: Array  # [B, K, T, S] each (query, slot)'s tile row x R + r; X R for an empty slot


def tile_map(idx_BKTS: Array, num_blocks: int, rows: int, seq_len: int) -> TileMap:
    """The tiles of the pairs ``idx_BKTS`` (each query's blocks, -1 empty) of ``num_blocks`` blocks;
    the queries past ``seq_len`` (the ragged last block's padding) take no pair."""
    b, kh, t, s = idx_BKTS.shape
    idx_BKTS = jnp.where((jnp.arange(t) < seq_len)[:, None], idx_BKTS, -1)

    def one_head(idx_TS):
        layout = block_grouped.pair_layout(idx_TS[None, None], num_blocks, tile=rows, chunk=1)
        return layout.rows, layout.blocks, block_grouped.slots(layout, (1, 1, t, s))[0, 0]

    rows_HZ, blocks_HX, index_HTS = jax.vmap(one_head)(idx_BKTS.reshape(b * kh, t, s))
    # one head's pair_layout marks an empty row with T, one past its last query
    rows_BKXR = jnp.where(rows_HZ < t, rows_HZ, -1).reshape(b, kh, -1, rows)
    return TileMap(rows_BKXR, blocks_HX.reshape(-1), index_HTS.reshape(b, kh, t, s))


def _by_head(x_BTH_: Array, kv_heads: int, t: int) -> Array:
    """[B,T,H,...] -> [B,K,T',G,...], zero rows past the sequence up to t."""
    x = jnp.pad(x_BTH_, ((0, 0), (0, t - x_BTH_.shape[1])) + ((0, 0),) * (x_BTH_.ndim - 2))
    b, _, h = x.shape[:3]
    return jnp.swapaxes(x.reshape(b, t, kv_heads, h // kv_heads, *x.shape[3:]), 1, 2)


def _from_heads(x_BKTG_: Array, t: int) -> Array:
    """The inverse of ``_by_head``: [B,K,T',G,...] -> [B,T,H,...]."""
    b, kh, tp, g = x_BKTG_.shape[:4]
    return jnp.swapaxes(x_BKTG_, 1, 2).reshape(b, tp, kh * g, *x_BKTG_.shape[4:])[:, :t]


def _to_tiles(x_BKTG_: Array, tiles: TileMap) -> Array:
    """Each tile's query rows [B,K,X,R G,...] of per-query rows [B,K,T',G,...] (padding reads row 0)."""
    b, kh, x, r = tiles.rows.shape
    y = jax.vmap(jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="clip")))(x_BKTG_, tiles.rows.reshape(b, kh, x * r))
    return y.reshape(b, kh, x, r * x_BKTG_.shape[3], *x_BKTG_.shape[4:])


def _per_pair(x_BKXL_: Array, tiles: TileMap, fill: float) -> Array:
    """[B,K,T',S,G,...]: each (query, slot)'s tile row of per-row values [B,K,X,R G,...] (``fill``
    for an empty slot)."""
    b, kh, t, s = tiles.index.shape
    x, r = tiles.rows.shape[2:]
    rows = x_BKXL_.reshape(b, kh, x * r, -1, *x_BKXL_.shape[4:])
    per_head = lambda a, i: jnp.take(a, i, axis=0, mode="fill", fill_value=fill)  # noqa: E731
    return jax.vmap(jax.vmap(per_head))(rows, tiles.index.reshape(b, kh, t * s)).reshape(b, kh, t, s, *rows.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    """(out [B,T,H,D], lse [B,T,H]) over the blocks ``idx_BKTS`` [B,K,T',S] (T' = T in whole blocks)."""
    return _attention_fwd(spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS)[0]


def fwd_layout(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    """(tile map, q by head [B,K,T',G,D], k, v [B,K,T',D], each tile row's position [B,K,X,L,1],
    each tile's query rows [B,K,X,L,D])."""
    kh, t = k_BTKD.shape[2], spec.padded_len
    tiles = tile_map(idx_BKTS, spec.num_blocks, spec.rows, spec.seq_len)
    q_BKTGD = _by_head(q_BTHD, kh, t)
    k_BKTD, v_BKTD = (jnp.swapaxes(_pad_to(x, t), 1, 2) for x in (k_BTKD, v_BTKD))
    pos_BKXL1 = jnp.repeat(tiles.rows, q_BKTGD.shape[3], axis=-1)[..., None]
    return tiles, q_BKTGD, k_BKTD, v_BKTD, pos_BKXL1, _to_tiles(q_BKTGD, tiles)


def fwd_kernels(spec: _Spec, tiles: TileMap, pos_BKXL1, q_BKXLD, k_BKTD, v_BKTD):
    """Each tile row's partial (o [B,K,X,L,D], lse [B,K,X,L,1]) float32."""
    return block_kernels.forward(tiles.blocks, pos_BKXL1, q_BKXLD, k_BKTD, v_BKTD, **spec.kwargs())


def fwd_merge(spec: _Spec, tiles: TileMap, o_BKXLD, lse_BKXL1, dtype):
    """(out [B,T,H,D] in ``dtype``, lse [B,T,H]): each query's S partials merged by their lse (an
    empty slot weighs exp(-inf) = 0; every query sees its own block, so only the padding past T
    has lse = -inf, and its weights are 0 too, not NaN)."""
    lse_BKTSG = _per_pair(lse_BKXL1[..., 0], tiles, -jnp.inf)
    lse_BKTG = jax.nn.logsumexp(lse_BKTSG, axis=3)
    w_BKTSG = jnp.exp(lse_BKTSG - jnp.where(jnp.isfinite(lse_BKTG), lse_BKTG, 0.0)[:, :, :, None])
    o_BKTGD = jnp.sum(w_BKTSG[..., None] * _per_pair(o_BKXLD, tiles, 0.0), axis=3)
    return _from_heads(o_BKTGD, spec.seq_len).astype(dtype), _from_heads(lse_BKTG, spec.seq_len)


def _attention_fwd(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    tiles, q_BKTGD, k_BKTD, v_BKTD, pos_BKXL1, q_BKXLD = fwd_layout(spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS)
    o_BKXLD, lse_BKXL1 = fwd_kernels(spec, tiles, pos_BKXL1, q_BKXLD, k_BKTD, v_BKTD)
    out_BTHD, lse_BTH = fwd_merge(spec, tiles, o_BKXLD, lse_BKXL1, q_BTHD.dtype)
    return (out_BTHD, lse_BTH), (tiles, q_BKTGD, k_BKTD, v_BKTD, pos_BKXL1, out_BTHD, lse_BTH)


def bwd_layout(spec: _Spec, residuals, cotangents):
    """The backward kernel's operands: (blocks, pos, q, k, v, do, lse, delta) in tiles."""
    tiles, q_BKTGD, k_BKTD, v_BKTD, pos_BKXL1, out_BTHD, lse_BTH = residuals
    do_BTHD, dlse_BTH = cotangents
    kh, t = k_BKTD.shape[1], spec.padded_len
    # d lse / d s = p, so an lse cotangent enters exactly like -delta (FlashAttention's D term)
    delta_BTH = jnp.sum(do_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1) - dlse_BTH
    lse_BKXL1, delta_BKXL1 = (_to_tiles(_by_head(x, kh, t), tiles)[..., None] for x in (lse_BTH, delta_BTH))
    do_BKXLD = _to_tiles(_by_head(do_BTHD.astype(q_BKTGD.dtype), kh, t), tiles)
    return tiles.blocks, pos_BKXL1, _to_tiles(q_BKTGD, tiles), k_BKTD, v_BKTD, do_BKXLD, lse_BKXL1, delta_BKXL1


def bwd_kernels(spec: _Spec, *args):
    """Each tile's (dq rows [B,K,X,L,D], dk, dv [B,K,X,J,D]) float32."""
    return block_kernels.backward(*args, **spec.kwargs())


def bwd_merge(spec: _Spec, tiles: TileMap, parts, q_dtype, kv_dtype):
    """(dq [B,T,H,D] in ``q_dtype``, dk, dv [B,T,K,D] in ``kv_dtype``): dq rows summed per query,
    dk and dv partials per block (the tiles are sorted by block: a segment sum; a tile holding
    only padding adds zeros to the block it names)."""
    dq_BKXLD, *dkdv = parts
    b, kh, x, j, d = dkdv[0].shape
    dq_BKTGD = jnp.sum(_per_pair(dq_BKXLD, tiles, 0.0), axis=3)
    sums = jax.vmap(lambda p, n: jax.ops.segment_sum(p, n, num_segments=spec.num_blocks, indices_are_sorted=True))
    blocks_HX = tiles.blocks.reshape(b * kh, x)
    dk_BTKD, dv_BTKD = (jnp.swapaxes(sums(p.reshape(b * kh, x, j, d), blocks_HX).reshape(b, kh, -1, d), 1, 2)[:, : spec.seq_len] for p in dkdv)
    return _from_heads(dq_BKTGD, spec.seq_len).astype(q_dtype), dk_BTKD.astype(kv_dtype), dv_BTKD.astype(kv_dtype)


def _attention_bwd(spec: _Spec, residuals, cotangents):
    args = bwd_layout(spec, residuals, cotangents)
    parts = bwd_kernels(spec, *args)
    return (*bwd_merge(spec, residuals[0], parts, residuals[1].dtype, residuals[2].dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(spec: _Spec, group: int, head_dim: int) -> None:
    """What the compilers take: Triton loads only power-of-two shapes and its dot wants every side
    >= 16 ([R G, D] query rows, [J, D] key blocks); on TPU the [J, D] key block needs J a multiple
    of 8 (sublanes)."""
    if spec.backend == "triton":
        for name, x in (("block_size", spec.block), ("query heads per KV head", group), ("head_dim", head_dim)):
            if x & (x - 1):
                raise ValueError(f"the Triton block-sparse kernels need {name} a power of two, got {x}")
        for name, x in (("block_size", spec.block), ("head_dim", head_dim)):
            if x < MIN_DOT:
                raise ValueError(f"the Triton block-sparse kernels need {name} >= {MIN_DOT} (tile products), got {x}")
    if spec.backend == "mosaic_tpu" and spec.block % 8:
        raise ValueError(f"the TPU block-sparse kernels need block_size a multiple of 8, got {spec.block}")


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "block_rank", "return_lse", "block_sizes", "backend"))
def block_sparse_attention_pallas(
    q: Array,
    k: Array,
    v: Array,
    *,
    block_size: int,
    num_blocks: int,
    block_rank: str = "mean_key",
    return_lse: bool = False,
    block_sizes: be.BlockSizes | None = None,
    backend: str | None = None,
):
    """:func:`fibjax.attention.block_sparse_attention` (no argument checks) on the Pallas tile
    kernels; ``block_sizes.block_q`` query rows per tile (R; ``block_k`` is unused here)."""
    t = q.shape[1]
    spec = _Spec(block_size, t, (block_sizes or be.BlockSizes()).fit(t), be.resolve(backend))
    _check_shapes(spec, q.shape[2] // k.shape[2], q.shape[3])
    top = num_earlier_blocks(t, block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, None, block=block_size, top=top, rule=block_rank, chunk=256)
    out, lse = _attention(spec, q, k, v, jax.lax.stop_gradient(idx_BKTS))
    return (out, lse) if return_lse else out
