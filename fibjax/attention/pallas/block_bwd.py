"""The Pallas dk/dv kernel of block-sparse attention: each key block walks the queries that chose it.

dk and dv of key block n sum over the (query, block n) pairs, so the kernel needs the inverse
of the forward's map: which query rows chose each block. It is built in XLA, per (batch, KV
head), by ``block_grouped.pair_layout`` (the pairs sorted by block, cut into *tiles* of R pairs
that all read one block): a block chosen by c queries fills ceil(c / R) tiles, the last one
part-filled, so there is no capacity to overflow and nothing to fall back on. A program owns one
tile: it reads its block's J keys and values once, walks the tile's pairs (a prefix of R rows:
the loop stops at the tile's count), recomputes p = exp(s - lse) from the forward's lse for the
row's G query heads and accumulates dk = ds^T q, dv = p^T do in float32. Each tile writes its
own partial [J, D]; XLA adds the partials of a block's tiles (sorted: a segment sum). Partials
rather than adding into one output block: Triton programs run in any order (a TPU could add
across a sequential tile axis; one code path for both was preferred), and the partials are ~3x
dk in float32 at R = 128, S = 16, J = 16 (at most ceil(T S / R) + T / J tiles).

Tile scalars: each tile's block and count, flat [B K X] int32. On TPU they are scalar-prefetched (``PrefetchScalarGridSpec``) and the
K/V index map reads the tile's block from them, so a program DMAs only its J x D keys and values
(splash attention's way of passing its mask's blocks); Triton has no scalar prefetch, so there
the kernel gets them as plain arrays and slices its block out of the whole K/V. A tile's query
rows [1, R] are a per-program SMEM block on TPU (the 1: a TPU block's second-last dimension is a
multiple of 8 or the array's whole dimension).

Layout: ``block_kernels``'s (q, do [B,K,G,T,D], k, v [B,K,T,D], lse, delta [B,K,G,T]).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fibjax.attention import block_grouped
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas.block_kernels import F32, block_keys, dots, row_of


class Tiles(NamedTuple):
    """The inverse map (integers, no gradient); X tiles per (batch, KV head), R pairs per tile."""

    rows: jax.Array  # [B, K, X, 1, R] the query row of each pair, T where empty
    blocks: jax.Array  # [B K X] the key block each tile reads (sorted within a head)
    counts: jax.Array  # [B K X] pairs in each tile: its first ``counts`` rows


def tiles_of(blocks_BKTS: jax.Array, num_blocks: int, tile: int) -> Tiles:
    """The tiles of the pairs ``blocks_BKTS`` (each query's blocks, -1 empty) of ``num_blocks`` blocks."""
    b, kh, t, s = blocks_BKTS.shape
    # one head at a time, so a pair's row is its query's position and the tiles' blocks are the head's own
    layout = jax.vmap(lambda idx_TS: block_grouped.pair_layout(idx_TS[None, None], num_blocks, tile=tile, chunk=1))(blocks_BKTS.reshape(b * kh, t, s))
    rows_HXR = layout.rows.reshape(b * kh, -1, tile)
    counts_HX = jnp.sum(rows_HXR < t, axis=-1, dtype=jnp.int32)
    return Tiles(rows_HXR.reshape(b, kh, -1, 1, tile), layout.blocks.reshape(-1), counts_HX.reshape(-1))


def _dkdv_kernel(block_ref, count_ref, rows_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, block, scale, kv_heads, whole_kv):
    group = q_ref.shape[0]
    tiles = pl.num_programs(2)
    tile = (pl.program_id(0) * kv_heads + pl.program_id(1)) * tiles + pl.program_id(2)
    n = block_ref[tile]
    k_JD, v_JD = block_keys(k_ref, v_ref, n * block if whole_kv else 0, block)
    key_1J = (n * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0))[None, :]

    def pair(r, acc):
        dk_JD, dv_JD = acc
        t = rows_ref[0, r]
        q_GD, do_GD = row_of(q_ref, t, group) * scale, row_of(do_ref, t, group)
        lse_G1, delta_G1 = row_of(lse_ref, t, group)[:, None], row_of(delta_ref, t, group)[:, None]
        p_GJ = jnp.where(key_1J <= t, jnp.exp(dots(q_GD, k_JD) - lse_G1), 0.0)  # causal: only the own block masks
        ds_GJ = p_GJ * (dots(do_GD, v_JD) - delta_G1)
        dk_JD = dk_JD + jnp.sum(ds_GJ[:, :, None] * q_GD[:, None, :], axis=0)  # q was scaled when loaded
        return dk_JD, dv_JD + jnp.sum(p_GJ[:, :, None] * do_GD[:, None, :], axis=0)

    zeros = jnp.zeros(dk_ref.shape, F32)
    dk_JD, dv_JD = jax.lax.fori_loop(0, count_ref[tile], pair, (zeros, zeros))
    dk_ref[...] = dk_JD
    dv_ref[...] = dv_JD


def dkdv_partials(q, k, v, do, lse, delta, tiles: Tiles, *, block: int, backend: str, block_sizes: be.BlockSizes, prefetch: bool | None = None):
    """Each tile's (dk, dv) [B,K,X,J,D] float32. ``prefetch``: the tile scalars by scalar prefetch
    and the K/V block by index map (default: on TPU only; the interpreter runs both ways)."""
    b, kh, g, t, d = q.shape
    x, _, r = tiles.rows.shape[2:]
    prefetch = backend == "mosaic_tpu" if prefetch is None else prefetch

    def whole(*shape):
        return pl.BlockSpec((None, None, *shape), lambda b, h, i, *_: (b, h) + (0,) * len(shape))

    if prefetch:  # index maps get the prefetched (blocks, counts) after the grid indices
        kv_spec = pl.BlockSpec((None, None, block, d), lambda b, h, i, blocks, counts: (b, h, blocks[(b * kh + h) * x + i], 0))
        scalar_specs = []
    else:
        kv_spec, scalar_specs = whole(t, d), [be.scalar_spec(backend)] * 2
    smem = dict(memory_space=pltpu.SMEM) if backend == "mosaic_tpu" else {}
    rows_spec = pl.BlockSpec((None, None, None, 1, r), lambda b, h, i, *_: (b, h, i, 0, 0), **smem)
    part_spec = pl.BlockSpec((None, None, None, block, d), lambda b, h, i, *_: (b, h, i, 0, 0))
    kernel = functools.partial(_dkdv_kernel, block=block, scale=d**-0.5, kv_heads=kh, whole_kv=not prefetch)
    return be.call(
        kernel,
        backend=backend,
        block_sizes=block_sizes,
        grid=(b, kh, x),
        in_specs=[*scalar_specs, rows_spec, whole(g, t, d), kv_spec, kv_spec, whole(g, t, d), whole(g, t), whole(g, t)],
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, kh, x, block, d), F32)] * 2,
        name="block_sparse_attention_dkdv",
        scalar_prefetch=2 if prefetch else 0,
    )(tiles.blocks, tiles.counts, tiles.rows, q, k, v, do, lse, delta)


def per_block(part_BKXJD: jax.Array, tiles: Tiles, num_blocks: int) -> jax.Array:
    """[B,K,N J,D]: each tile's partial added into its block (the tiles are sorted by block: a segment sum)."""
    b, kh, _, block, d = part_BKXJD.shape
    sums = jax.vmap(lambda p, n: jax.ops.segment_sum(p, n, num_segments=num_blocks, indices_are_sorted=True))
    return sums(part_BKXJD.reshape(b * kh, *part_BKXJD.shape[2:]), tiles.blocks.reshape(b * kh, -1)).reshape(b, kh, num_blocks * block, d)
