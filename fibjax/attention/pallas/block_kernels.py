"""The Pallas tile kernels of block-sparse attention: one program per tile of queries that chose one key block.

Before the kernels run, the map from queries to blocks is inverted (``block_ops.tile_map``): the
(query, block) pairs of a (batch, KV head) sorted by block and cut into tiles of R query rows
that all chose the same block n. A program owns one tile: its R rows times the G query heads of
the KV group, stacked (row r G + g), against the block's J keys. So the products are real tiles
for a GPU's tensor cores, s = q k^T [R G, J] and p v [R G, D], with float32 accumulation and
bf16 operands kept bf16. The causal rule is the same for every tile: query t sees key j of
block n iff t >= n J + j, which is false only in the query's own block. Padding rows carry
t = -1 and see nothing.

* forward (``forward``): each row's softmax over this block alone, (o normalised [R G, D]
  float32, lse [R G, 1]; a row that sees nothing gets o = 0 and lse = -inf). ``block_ops``
  merges a query's S partials by their lse.
* backward (``backward``), one kernel: p = exp(s - lse) from the merged lse, ds = p (do v^T -
  delta). It writes the tile's dq rows ds k, which XLA sums per query through the forward index,
  and the block's dk = ds^T q and dv = p^T do, which XLA sums per block. Every program writes
  only its own outputs: there are no atomics, and programs may run in any order.

A tile's block index is data. On TPU it is scalar-prefetched, and the K/V index map copies only
that J x D block in (splash attention's pattern). Triton has no scalar prefetch, so there (and
in the interpreter, unless ``prefetch``) the kernel reads the index from an array and slices its
block out of the (batch, KV head)'s whole K/V.

Layout (``block_ops`` builds it; X tiles per (batch, KV head)):
q, do       [B, K, X, R G, D]  each tile's query rows, gathered in XLA
pos         [B, K, X, R G, 1]  int32, each row's query position (-1: padding)
lse, delta  [B, K, X, R G, 1]  float32 (delta = rowsum(do * out) - d lse)
k, v        [B, K, T, D]       T in whole blocks
blocks      [B K X]            int32, each tile's key block
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas.kernels import F32, _dot


def _block(blocks_ref, k_ref, v_ref, *, block: int, whole_kv: bool):
    """(n, K rows [J, D], V rows [J, D]) of this program's tile."""
    tile = (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * pl.num_programs(2) + pl.program_id(2)
    n = blocks_ref[tile]
    start = n * block if whole_kv else 0  # with prefetch the index map already chose the block
    return n, k_ref[pl.ds(start, block), :], v_ref[pl.ds(start, block), :]


def _visible(pos_ref, n, block: int):
    """[R G, J]: the row's query t sees key n J + j (t >= n J + j; padding rows have t = -1)."""
    rows = pos_ref.shape[0]
    return pos_ref[...] >= n * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)


def _forward_kernel(blocks_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block: int, scale: float, whole_kv: bool):
    n, k_JD, v_JD = _block(blocks_ref, k_ref, v_ref, block=block, whole_kv=whole_kv)
    s_LJ = jnp.where(_visible(pos_ref, n, block), _dot(q_ref[...], k_JD, (1, 1)) * scale, -jnp.inf)
    m_L1 = jnp.max(s_LJ, axis=1, keepdims=True)
    seen_L1 = m_L1 > -jnp.inf
    p_LJ = jnp.exp(s_LJ - jnp.where(seen_L1, m_L1, 0.0))  # a row that sees nothing: exp(-inf) = 0, never inf - inf
    l_L1 = jnp.where(seen_L1, jnp.sum(p_LJ, axis=1, keepdims=True), 1.0)
    o_ref[...] = _dot(p_LJ.astype(v_JD.dtype), v_JD) / l_L1
    lse_ref[...] = jnp.where(seen_L1, m_L1 + jnp.log(l_L1), -jnp.inf)


def _backward_kernel(blocks_ref, pos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *, block: int, scale: float, whole_kv: bool):
    n, k_JD, v_JD = _block(blocks_ref, k_ref, v_ref, block=block, whole_kv=whole_kv)
    q_LD, do_LD = q_ref[...], do_ref[...]
    # select, never multiply: a padding row's lse is -inf, and exp(s - lse) would be inf
    p_LJ = jnp.where(_visible(pos_ref, n, block), jnp.exp(_dot(q_LD, k_JD, (1, 1)) * scale - lse_ref[...]), 0.0)
    ds_LJ = p_LJ * (_dot(do_LD, v_JD, (1, 1)) - delta_ref[...])
    dq_ref[...] = _dot(ds_LJ.astype(k_JD.dtype), k_JD) * scale
    dk_ref[...] = _dot(ds_LJ.astype(q_LD.dtype), q_LD, (0, 0)) * scale
    dv_ref[...] = _dot(p_LJ.astype(do_LD.dtype), do_LD, (0, 0))


def _call(kernel, name: str, q, k, blocks, tiled, outs, *, block: int, backend: str, block_sizes: be.BlockSizes, prefetch: bool | None):
    """A ``pallas_call`` over the grid (B, K, X): ``tiled`` operands [B,K,X,...] one tile a program,
    k and v by block, ``outs`` (shapes [B,K,X,...], float32) one tile a program."""
    b, kh, x = q.shape[:3]
    t, d = k.shape[2:]
    prefetch = backend == "mosaic_tpu" if prefetch is None else prefetch

    def tile(a):
        return pl.BlockSpec((None, None, None, *a.shape[3:]), lambda b, h, i, *_: (b, h, i) + (0,) * (len(a.shape) - 3))

    if prefetch:  # index maps get the prefetched blocks after the grid indices
        kv_spec = pl.BlockSpec((None, None, block, d), lambda b, h, i, blocks: (b, h, blocks[(b * kh + h) * x + i], 0))
        scalar_specs = []
    else:
        kv_spec, scalar_specs = pl.BlockSpec((None, None, t, d), lambda b, h, i, *_: (b, h, 0, 0)), [be.scalar_spec(backend)]
    pos, q_tiles, *rest = tiled
    kernel = functools.partial(kernel, block=block, scale=d**-0.5, whole_kv=not prefetch)
    return be.call(
        kernel,
        backend=backend,
        block_sizes=block_sizes,
        grid=(b, kh, x),
        in_specs=[*scalar_specs, tile(pos), tile(q_tiles), kv_spec, kv_spec, *map(tile, rest)],
        out_specs=[tile(jax.ShapeDtypeStruct(s, F32)) for s in outs],
        out_shape=[jax.ShapeDtypeStruct(s, F32) for s in outs],
        name=name,
        scalar_prefetch=1 if prefetch else 0,
    )


def forward(blocks, pos, q, k, v, *, block: int, backend: str, block_sizes: be.BlockSizes, prefetch: bool | None = None):
    """Each tile row's partial (o [B,K,X,R G,D], lse [B,K,X,R G,1]) float32 over its tile's block.
    ``prefetch``: the tile blocks by scalar prefetch and the K/V block by index map (default: on
    TPU only; the interpreter runs both ways)."""
    outs = (q.shape, (*q.shape[:4], 1))
    call = _call(
        _forward_kernel, "block_sparse_attention_fwd", q, k, blocks, (pos, q), outs, block=block, backend=backend, block_sizes=block_sizes, prefetch=prefetch
    )
    return call(blocks, pos, q, k, v)


def backward(blocks, pos, q, k, v, do, lse, delta, *, block: int, backend: str, block_sizes: be.BlockSizes, prefetch: bool | None = None):
    """Each tile's (dq rows [B,K,X,R G,D], dk [B,K,X,J,D], dv [B,K,X,J,D]) float32, ``forward``'s
    layout; do like q, lse and delta like pos."""
    d = q.shape[-1]
    outs = (q.shape, (*q.shape[:3], block, d), (*q.shape[:3], block, d))
    tiled = (pos, q, do, lse, delta)
    call = _call(
        _backward_kernel, "block_sparse_attention_bwd", q, k, blocks, tiled, outs, block=block, backend=backend, block_sizes=block_sizes, prefetch=prefetch
    )
    return call(blocks, pos, q, k, v, do, lse, delta)
