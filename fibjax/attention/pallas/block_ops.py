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

**Options** (``block_kernels.BlockKernelOptions``, issue 53) change where the work happens, not
what is computed: with ``gather_in_kernel`` the layouts hand the kernels each (batch, KV head)'s
whole rows instead of gathered tiles; with ``blocks_per_tile`` m > 1 the pairs are (query, span
of m blocks) with the span's chosen blocks as bits (``spans``); with ``bf16_partials`` the merges
widen the partials to float32 before summing; with ``skip_padding_tiles`` the backward merge
drops the tiles past the used ones (their programs wrote nothing).

Each stage is a named function (``fwd_layout``, ``fwd_kernels``, ``fwd_merge``, ``bwd_layout``,
``bwd_kernels``, ``bwd_merge``), so ``fibjax.bench.phases`` times the functions the path runs.
Letters: X tiles, R query rows a tile, L = R G kernel rows, S slots, N blocks of J keys, spans of
W = m J keys (m blocks a tile; m = 1 by default, a span is a block).
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
from fibjax.attention.pallas.block_kernels import BlockKernelOptions
from fibjax.attention.pallas.kernels import F32, MIN_DOT


class _Spec(NamedTuple):
    """Everything static about one call (hashable: a ``nondiff_argnums`` argument)."""

    block: int  # keys per block (J)
    seq_len: int
    block_sizes: be.BlockSizes  # block_q: query rows per tile (R)
    backend: str
    options: BlockKernelOptions = BlockKernelOptions()

    @property
    def span(self) -> int:
        """W = m J: the keys a tile reads."""
        return self.block * self.options.blocks_per_tile

    @property
    def num_spans(self) -> int:
        return -(-self.seq_len // self.span)

    @property
    def padded_len(self) -> int:
        """T in whole spans."""
        return self.num_spans * self.span

    @property
    def rows(self) -> int:
        """R; at least 16 on Triton (its dot wants every side >= 16)."""
        return max(self.block_sizes.block_q, MIN_DOT) if self.backend == "triton" else self.block_sizes.block_q

    def kwargs(self) -> dict:
        return dict(block=self.block, backend=self.backend, block_sizes=self.block_sizes, options=self.options)


class TileMap(NamedTuple):
    """The choice inverted, per (batch, KV head): int32, no gradient. X tiles of R query rows."""

    rows: Array  # [B, K, X, R] each tile row's query position, -1 for padding
    blocks: Array  # [B K X] each tile's key span, sorted within a (batch, KV head)
    index: Array  # [B, K, T, S] each (query, slot)'s tile row x R + r; X R for an empty slot
    used: Array  # [B, K] the tiles holding a pair: the first ``used`` of each (batch, KV head)
    bits: Array | None = None  # [B, K, X, R] each row's chosen blocks of its tile's span (``spans``)


def spans(idx_BKTS: Array, blocks_per_span: int) -> tuple[Array, Array]:
    """Each query's S blocks (-1 empty) as spans of m = ``blocks_per_span`` blocks: (its spans
    [B,K,T,S], each once, at the first slot that names it, -1 elsewhere; the blocks of that span it
    chose [B,K,T,S], bit i for block n m + i). A query's blocks are distinct, so their bits add
    up to the or of them."""
    real = idx_BKTS >= 0
    span = jnp.where(real, idx_BKTS // blocks_per_span, -1)
    bit = jnp.where(real, jnp.left_shift(1, idx_BKTS % blocks_per_span), 0)
    same_BKTSS = (span[..., :, None] == span[..., None, :]) & real[..., :, None]
    bits = jnp.sum(jnp.where(same_BKTSS, bit[..., None, :], 0), axis=-1)
    s = idx_BKTS.shape[-1]
    first = real & ~jnp.any(same_BKTSS & jnp.tri(s, k=-1, dtype=bool), axis=-1)  # no earlier slot names it
    return jnp.where(first, span, -1), jnp.where(first, bits, 0)


def tile_map(idx_BKTS: Array, num_blocks: int, rows: int, seq_len: int, bits_BKTS: Array | None = None) -> TileMap:
    """The tiles of the pairs ``idx_BKTS`` (each query's blocks, or spans, -1 empty) of
    ``num_blocks`` blocks (spans); the queries past ``seq_len`` (the ragged last block's padding)
    take no pair. ``bits_BKTS``: each pair's chosen blocks of its span, laid out in the tiles."""
    b, kh, t, s = idx_BKTS.shape
    idx_BKTS = jnp.where((jnp.arange(t) < seq_len)[:, None], idx_BKTS, -1)

    def one_head(idx_TS):
        layout = block_grouped.pair_layout(idx_TS[None, None], num_blocks, tile=rows, chunk=1)
        return layout.rows, layout.blocks, block_grouped.slots(layout, (1, 1, t, s))[0, 0]

    rows_HZ, blocks_HX, index_HTS = jax.vmap(one_head)(idx_BKTS.reshape(b * kh, t, s))
    # one head's pair_layout marks an empty row with T, one past its last query
    rows_BKXR = jnp.where(rows_HZ < t, rows_HZ, -1).reshape(b, kh, -1, rows)
    x = rows_BKXR.shape[2]
    index_BKTS = index_HTS.reshape(b, kh, t, s)
    # a block's tiles fill from their first row, so a tile holds a pair iff its first row does
    used_BK = jnp.sum(rows_BKXR[..., 0] >= 0, axis=-1, dtype=jnp.int32)
    bits_BKXR = None
    if bits_BKTS is not None:  # an empty slot's index is X R: dropped
        at_rows = lambda i, v: jnp.zeros(x * rows, jnp.int32).at[i.reshape(-1)].set(v.reshape(-1), mode="drop")  # noqa: E731
        bits_BKXR = jax.vmap(jax.vmap(at_rows))(index_BKTS, bits_BKTS).reshape(b, kh, x, rows)
    return TileMap(rows_BKXR, blocks_HX.reshape(-1), index_BKTS, used_BK, bits_BKXR)


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


def _per_row(x_BKXR: Array, group: int) -> Array:
    """A tile row's value for each of its G kernel rows: [B,K,X,R] -> [B,K,X,R G,1]."""
    return jnp.repeat(x_BKXR, group, axis=-1)[..., None]


def _kernel_rows(spec: _Spec, x_BKTG_: Array, tiles: TileMap) -> Array:
    """A per-query operand [B,K,T',G,C] as the kernels read it: each tile's rows [B,K,X,R G,C]
    (gathered here), or with ``gather_in_kernel`` each (batch, KV head)'s whole rows [B,K,T' G,C]
    (the kernel gathers them)."""
    if spec.options.gather_in_kernel:
        b, kh, t, g = x_BKTG_.shape[:4]
        return x_BKTG_.reshape(b, kh, t * g, *x_BKTG_.shape[4:])
    return _to_tiles(x_BKTG_, tiles)


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
    the query rows as the kernel reads them (``_kernel_rows``)); T' = T in whole spans."""
    kh, t, m = k_BTKD.shape[2], spec.padded_len, spec.options.blocks_per_tile
    pairs_BKTS, bits_BKTS = spans(idx_BKTS, m) if m > 1 else (idx_BKTS, None)
    tiles = tile_map(pairs_BKTS, spec.num_spans, spec.rows, spec.seq_len, bits_BKTS)
    q_BKTGD = _by_head(q_BTHD, kh, t)
    k_BKTD, v_BKTD = (jnp.swapaxes(_pad_to(x, t), 1, 2) for x in (k_BTKD, v_BTKD))
    return tiles, q_BKTGD, k_BKTD, v_BKTD, _per_row(tiles.rows, q_BKTGD.shape[3]), _kernel_rows(spec, q_BKTGD, tiles)


def _optional(spec: _Spec, tiles: TileMap, group: int) -> dict:
    """The kernels' operands that only some options use: ``bits`` and ``used``."""
    return dict(bits=None if tiles.bits is None else _per_row(tiles.bits, group), used=tiles.used if spec.options.skip_padding_tiles else None)


def fwd_kernels(spec: _Spec, tiles: TileMap, pos_BKXL1, q_rows, k_BKTD, v_BKTD):
    """Each tile row's partial (o [B,K,X,L,D] of the options' partial dtype, lse [B,K,X,L,1] float32)."""
    group = pos_BKXL1.shape[3] // tiles.rows.shape[3]
    return block_kernels.forward(tiles.blocks, pos_BKXL1, q_rows, k_BKTD, v_BKTD, **spec.kwargs(), **_optional(spec, tiles, group))


def fwd_merge(spec: _Spec, tiles: TileMap, o_BKXLD, lse_BKXL1, dtype):
    """(out [B,T,H,D] in ``dtype``, lse [B,T,H]): each query's S partials merged by their lse (an
    empty slot weighs exp(-inf) = 0; every query sees its own block, so only the padding past T
    has lse = -inf, and its weights are 0 too, not NaN). Partials in bfloat16 meet float32 weights:
    the sum is float32."""
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
    """The backward kernel's operands: (tiles, pos, q, k, v, do, lse, delta), the per-query ones
    as the kernel reads them (``_kernel_rows``)."""
    tiles, q_BKTGD, k_BKTD, v_BKTD, pos_BKXL1, out_BTHD, lse_BTH = residuals
    do_BTHD, dlse_BTH = cotangents
    kh, t = k_BKTD.shape[1], spec.padded_len
    # d lse / d s = p, so an lse cotangent enters exactly like -delta (FlashAttention's D term)
    delta_BTH = jnp.sum(do_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1) - dlse_BTH
    lse_rows, delta_rows = (_kernel_rows(spec, _by_head(x, kh, t)[..., None], tiles) for x in (lse_BTH, delta_BTH))
    do_rows = _kernel_rows(spec, _by_head(do_BTHD.astype(q_BKTGD.dtype), kh, t), tiles)
    return tiles, pos_BKXL1, _kernel_rows(spec, q_BKTGD, tiles), k_BKTD, v_BKTD, do_rows, lse_rows, delta_rows


def bwd_kernels(spec: _Spec, tiles: TileMap, pos_BKXL1, *args):
    """Each tile's (dq rows [B,K,X,L,D], dk, dv [B,K,X,W,D]) of the options' partial dtype."""
    group = pos_BKXL1.shape[3] // tiles.rows.shape[3]
    return block_kernels.backward(tiles.blocks, pos_BKXL1, *args, **spec.kwargs(), **_optional(spec, tiles, group))


def bwd_merge(spec: _Spec, tiles: TileMap, parts, q_dtype, kv_dtype):
    """(dq [B,T,H,D] in ``q_dtype``, dk, dv [B,T,K,D] in ``kv_dtype``): dq rows summed per query,
    dk and dv partials per span (the tiles are sorted by span: a segment sum; a tile holding
    only padding adds zeros to the span it names, or with ``skip_padding_tiles`` is dropped, its
    program having written nothing), all in float32."""
    dq_BKXLD, *dkdv = parts
    b, kh, x, w, d = dkdv[0].shape
    dq_BKTGD = jnp.sum(_per_pair(dq_BKXLD, tiles, 0.0).astype(F32), axis=3)
    sums = jax.vmap(lambda p, n: jax.ops.segment_sum(p, n, num_segments=spec.num_spans, indices_are_sorted=True))
    blocks_HX = tiles.blocks.reshape(b * kh, x)
    if spec.options.skip_padding_tiles:  # span N: out of range, dropped by the segment sum
        blocks_HX = jnp.where(jnp.arange(x) < tiles.used.reshape(-1, 1), blocks_HX, spec.num_spans)
    dk_BTKD, dv_BTKD = (jnp.swapaxes(sums(p.reshape(b * kh, x, w, d).astype(F32), blocks_HX).reshape(b, kh, -1, d), 1, 2)[:, : spec.seq_len] for p in dkdv)
    return _from_heads(dq_BKTGD, spec.seq_len).astype(q_dtype), dk_BTKD.astype(kv_dtype), dv_BTKD.astype(kv_dtype)


def _attention_bwd(spec: _Spec, residuals, cotangents):
    args = bwd_layout(spec, residuals, cotangents)
    parts = bwd_kernels(spec, *args)
    return (*bwd_merge(spec, residuals[0], parts, residuals[1].dtype, residuals[2].dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(spec: _Spec, group: int, head_dim: int) -> None:
    """What the compilers take: Triton loads only power-of-two shapes and its dot wants every side
    >= 16 ([R G, D] query rows, [J, D] key blocks); on TPU the [J, D] key block needs J a multiple
    of 8 (sublanes), and Mosaic has no gather of rows from VMEM (``gather_in_kernel``)."""
    if spec.backend == "triton":
        for name, x in (("block_size", spec.block), ("query heads per KV head", group), ("head_dim", head_dim)):
            if x & (x - 1):
                raise ValueError(f"the Triton block-sparse kernels need {name} a power of two, got {x}")
        for name, x in (("block_size", spec.block), ("head_dim", head_dim)):
            if x < MIN_DOT:
                raise ValueError(f"the Triton block-sparse kernels need {name} >= {MIN_DOT} (tile products), got {x}")
    if spec.backend == "mosaic_tpu" and spec.block % 8:
        raise ValueError(f"the TPU block-sparse kernels need block_size a multiple of 8, got {spec.block}")
    if spec.backend == "mosaic_tpu" and spec.options.gather_in_kernel:
        raise ValueError("the TPU block-sparse kernels cannot gather rows in the kernel (gather_in_kernel)")


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "block_rank", "return_lse", "block_sizes", "backend", "options"))
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
    options: BlockKernelOptions | None = None,
):
    """[fibjax.attention.block_sparse_attention][fibjax.attention.block_sparse_attention] (no argument checks) on the Pallas tile
    kernels; ``block_sizes.block_q`` query rows per tile (R; ``block_k`` is unused here);
    ``options``: how the kernels do it (``block_kernels.VARIANTS``; default: the plain kernels)."""
    t = q.shape[1]
    spec = _Spec(block_size, t, (block_sizes or be.BlockSizes()).fit(t), be.resolve(backend), options or BlockKernelOptions())
    _check_shapes(spec, q.shape[2] // k.shape[2], q.shape[3])
    top = num_earlier_blocks(t, block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, None, block=block_size, top=top, rule=block_rank, chunk=256)
    out, lse = _attention(spec, q, k, v, jax.lax.stop_gradient(idx_BKTS))
    return (out, lse) if return_lse else out
