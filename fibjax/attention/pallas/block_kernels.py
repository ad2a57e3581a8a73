"""The Pallas tile kernels of block-sparse attention: one program per tile of queries that chose one key span.

Before the kernels run, the map from queries to blocks is inverted (``block_ops.tile_map``): the
(query, span) pairs of a (batch, KV head) sorted by span and cut into tiles of R query rows
that all chose the same span n. A span is ``blocks_per_tile`` consecutive key blocks (one by
default: a span is a block). A program owns one tile: its R rows times the G query heads of
the KV group, stacked (row r G + g), against the span's W keys. So the products are real tiles
for a GPU's tensor cores, s = q k^T [R G, W] and p v [R G, D], with float32 accumulation and
bf16 operands kept bf16. The causal rule is the same for every tile: query t sees key j of
span n iff t >= n W + j, which is false only in the query's own block; with several blocks a
span, a row also sees only the blocks it chose (``bits``). Padding rows carry t = -1 and see
nothing.

* forward (``forward``): each row's softmax over this span alone, (o normalised [R G, D], lse
  [R G, 1] float32; a row that sees nothing gets o = 0 and lse = -inf). ``block_ops`` merges a
  query's S partials by their lse.
* backward (``backward``), one kernel: p = exp(s - lse) from the merged lse, ds = p (do v^T -
  delta). It writes the tile's dq rows ds k, which XLA sums per query through the forward index,
  and the span's dk = ds^T q and dv = p^T do, which XLA sums per span. Every program writes
  only its own outputs: there are no atomics, and programs may run in any order.

A tile's span index is data. On TPU it is scalar-prefetched, and the K/V index map copies only
that W x D span in (splash attention's pattern). Triton has no scalar prefetch, so there (and
in the interpreter, unless ``prefetch``) the kernel reads the index from an array and slices its
span out of the (batch, KV head)'s whole K/V.

**Options** (``BlockKernelOptions``; named variants in ``VARIANTS``, issue 53): the same work done
four other ways, each a choice only a GPU measurement can make (BUILD_NOTES, "Block-sparse
kernels": the gathers and the float32 partials go through HBM):
(a) ``gather_in_kernel``: the kernel loads its rows of q (backward: q, do, lse, delta) by index
    from the (batch, KV head)'s whole arrays (Triton pointer loads), instead of XLA gathering them
    into tiles before it; not on TPU (Mosaic has no vector gather from VMEM);
(b) ``bf16_partials``: the partial outputs (o; dq rows, dk and dv partials) written in bfloat16,
    half the bytes, summed in float32 by the merges; lse stays float32;
(c) ``skip_padding_tiles``: the programs of the tiles past those a choice fills (X is a static
    bound) return at once, reading and writing nothing; the merges never read their outputs;
(d) ``blocks_per_tile`` m > 1: tiles of m J keys (m consecutive blocks), so a query that chose
    several blocks of one span is one tile row, and the products are [R G, m J].

Layout (``block_ops`` builds it; X tiles per (batch, KV head), L = R G):
q, do       [B, K, X, L, D]    each tile's query rows, gathered in XLA (gather_in_kernel:
                               [B, K, T G, D], each (batch, KV head)'s rows, row t G + g)
pos         [B, K, X, L, 1]    int32, each row's query position (-1: padding)
bits        [B, K, X, L, 1]    int32, the blocks of its span each row chose (bit i: block n m + i)
lse, delta  [B, K, X, L, 1]    float32 (delta = rowsum(do * out) - d lse; gather_in_kernel: [B, K, T G])
k, v        [B, K, T, D]       T in whole spans
blocks      [B K X]            int32, each tile's span
used        [B K]              int32, the tiles a choice fills (the first ones of each (batch, KV head))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas.kernels import F32, _dot


@dataclasses.dataclass(frozen=True)
class BlockKernelOptions:
    """How the kernels lay out and do the same work (module docstring, "Options"); the default is
    the kernels as they were before the options existed."""

    gather_in_kernel: bool = False
    bf16_partials: bool = False
    skip_padding_tiles: bool = False
    blocks_per_tile: int = 1

    def __post_init__(self):
        m = self.blocks_per_tile
        if m < 1 or m & (m - 1):
            raise ValueError(f"blocks_per_tile must be a power of two, got {m}")

    @property
    def partial_dtype(self):
        return jnp.bfloat16 if self.bf16_partials else F32


DEFAULT = BlockKernelOptions()
# the variants ``launch.bench attention --pallas-variants`` times side by side (each option alone,
# then all four together); "default" first: the others' ratios are over it
VARIANTS: dict[str, BlockKernelOptions] = {
    "default": DEFAULT,
    "gather": BlockKernelOptions(gather_in_kernel=True),
    "bf16_partials": BlockKernelOptions(bf16_partials=True),
    "skip_padding": BlockKernelOptions(skip_padding_tiles=True),
    "blocks4": BlockKernelOptions(blocks_per_tile=4),
    "combined": BlockKernelOptions(gather_in_kernel=True, bf16_partials=True, skip_padding_tiles=True, blocks_per_tile=4),
}


def _span(blocks, k, v, head, tile, *, span: int, whole_kv: bool):
    """(n, K rows [W, D], V rows [W, D]) of tile ``tile`` of (batch, KV head) ``head``."""
    n = blocks[head * pl.num_programs(2) + tile]
    start = n * span if whole_kv else 0  # with prefetch the index map already chose the span
    return n, k[pl.ds(start, span), :], v[pl.ds(start, span), :]


def _visible(pos, bits, n, *, span: int, block: int):
    """[L, W]: the row's query t sees key n W + j (t >= n W + j; padding rows have t = -1) and,
    with several blocks a span, chose key j's block (bit j // J of its ``bits``)."""
    j = jax.lax.broadcasted_iota(jnp.int32, (pos.shape[0], span), 1)
    seen = pos[...] >= n * span + j
    if bits is None:
        return seen
    # the blocks one at a time (static shifts and bounds: Mosaic lowers no per-element shift)
    chosen = [((bits[...] >> i) & 1 == 1) & (j >= i * block) & (j < (i + 1) * block) for i in range(span // block)]
    return seen & functools.reduce(jnp.logical_or, chosen)


def _row_reader(pos, gather: bool, group: int):
    """``read(ref)``: this tile's [L, ...] rows of a per-row operand: the tile's own block, or
    (``gather``) rows t G + g of the (batch, KV head)'s whole array (padding reads row g)."""
    if not gather:
        return lambda ref: ref[...]
    p = pos[...]
    idx_L = (jnp.maximum(p, 0) * group + jax.lax.broadcasted_iota(jnp.int32, p.shape, 0) % group)[:, 0]
    return lambda ref: ref[idx_L, :] if len(ref.shape) == 2 else ref[idx_L][:, None]


def _live(used, body) -> None:
    """``body(head)`` (head: the program's (batch, KV head) index), or with ``used`` only in the
    tiles a choice fills (the rest return at once). The program ids are read out here: the
    interpreter has none inside a ``pl.when``."""
    head, tile = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1), pl.program_id(2)
    if used is None:
        body(head, tile)
    else:
        pl.when(tile < used[head])(lambda: body(head, tile))


def _forward_kernel(*, blocks, used=None, pos, bits=None, q, k, v, o, lse, block, span, scale, whole_kv, gather, group):
    def body(head, tile):
        n, k_WD, v_WD = _span(blocks, k, v, head, tile, span=span, whole_kv=whole_kv)
        q_LD = _row_reader(pos, gather, group)(q)
        s_LW = jnp.where(_visible(pos, bits, n, span=span, block=block), _dot(q_LD, k_WD, (1, 1)) * scale, -jnp.inf)
        m_L1 = jnp.max(s_LW, axis=1, keepdims=True)
        seen_L1 = m_L1 > -jnp.inf
        p_LW = jnp.exp(s_LW - jnp.where(seen_L1, m_L1, 0.0))  # a row that sees nothing: exp(-inf) = 0, never inf - inf
        l_L1 = jnp.where(seen_L1, jnp.sum(p_LW, axis=1, keepdims=True), 1.0)
        o[...] = (_dot(p_LW.astype(v_WD.dtype), v_WD) / l_L1).astype(o.dtype)
        lse[...] = jnp.where(seen_L1, m_L1 + jnp.log(l_L1), -jnp.inf)

    _live(used, body)


def _backward_kernel(*, blocks, used=None, pos, bits=None, q, k, v, do, lse, delta, dq, dk, dv, block, span, scale, whole_kv, gather, group):
    def body(head, tile):
        n, k_WD, v_WD = _span(blocks, k, v, head, tile, span=span, whole_kv=whole_kv)
        read = _row_reader(pos, gather, group)
        q_LD, do_LD = read(q), read(do)
        # select, never multiply: a padding row's lse is -inf, and exp(s - lse) would be inf
        p_LW = jnp.where(_visible(pos, bits, n, span=span, block=block), jnp.exp(_dot(q_LD, k_WD, (1, 1)) * scale - read(lse)), 0.0)
        ds_LW = p_LW * (_dot(do_LD, v_WD, (1, 1)) - read(delta))
        dq[...] = (_dot(ds_LW.astype(k_WD.dtype), k_WD) * scale).astype(dq.dtype)
        dk[...] = (_dot(ds_LW.astype(q_LD.dtype), q_LD, (0, 0)) * scale).astype(dk.dtype)
        dv[...] = _dot(p_LW.astype(do_LD.dtype), do_LD, (0, 0)).astype(dv.dtype)

    _live(used, body)


def _call(
    kernel,
    name: str,
    scalars: dict,
    tiled: dict,
    whole: dict,
    k,
    v,
    outs: dict,
    *,
    block: int,
    options: BlockKernelOptions,
    backend: str,
    block_sizes: be.BlockSizes,
    prefetch: bool | None,
):
    """A ``pallas_call`` over the grid (B, K, X) of ``kernel``, which takes its refs by name:
    ``scalars`` (blocks; used) read one at a time, ``tiled`` operands [B,K,X,...] one tile a
    program, ``whole`` operands [B,K,...] the (batch, KV head)'s whole array, k and v by span,
    and ``outs`` {name: shape [B,K,X,...]} one tile a program, each of ``options.partial_dtype``
    except lse (float32)."""
    b, kh, x = tiled["pos"].shape[:3]
    t, d = k.shape[2:]
    span = block * options.blocks_per_tile
    prefetch = backend == "mosaic_tpu" if prefetch is None else prefetch

    def tile(shape):
        return pl.BlockSpec((None, None, None, *shape[3:]), lambda b, h, i, *_: (b, h, i) + (0,) * (len(shape) - 3))

    def per_head(shape):
        return pl.BlockSpec((None, None, *shape[2:]), lambda b, h, i, *_: (b, h) + (0,) * (len(shape) - 2))

    if prefetch:  # index maps get the prefetched scalars after the grid indices
        kv_spec = pl.BlockSpec((None, None, span, d), lambda b, h, i, blocks, *_: (b, h, blocks[(b * kh + h) * x + i], 0))
        scalar_specs = []
    else:
        kv_spec, scalar_specs = per_head(k.shape), [be.scalar_spec(backend)] * len(scalars)
    names = [*scalars, *tiled, *whole, "k", "v", *outs]
    group = whole["q"].shape[2] // t if whole else 1  # whole q is [B, K, T G, D]
    config = dict(block=block, span=span, scale=d**-0.5, whole_kv=not prefetch, gather=options.gather_in_kernel, group=group)
    out_types = [jax.ShapeDtypeStruct(s, F32 if n == "lse" else options.partial_dtype) for n, s in outs.items()]
    call = be.call(
        lambda *refs: kernel(**dict(zip(names, refs)), **config),
        backend=backend,
        block_sizes=block_sizes,
        grid=(b, kh, x),
        in_specs=[*scalar_specs, *(tile(a.shape) for a in tiled.values()), *(per_head(a.shape) for a in whole.values()), kv_spec, kv_spec],
        out_specs=[tile(s.shape) for s in out_types],
        out_shape=out_types,
        name=name,
        scalar_prefetch=len(scalars) if prefetch else 0,
    )
    return call(*scalars.values(), *tiled.values(), *whole.values(), k, v)


def _operands(options: BlockKernelOptions, blocks, used, pos, bits, per_row: dict):
    """(scalars, tiled, whole) of ``_call``: the optional ones only where an option needs them."""
    if options.skip_padding_tiles != (used is not None) or (options.blocks_per_tile > 1) != (bits is not None):
        raise ValueError("used goes with skip_padding_tiles, bits with blocks_per_tile > 1")
    scalars = {"blocks": blocks, **({"used": used.reshape(-1)} if used is not None else {})}
    tiled = {"pos": pos, **({"bits": bits} if bits is not None else {})}
    if options.gather_in_kernel:
        return scalars, tiled, per_row
    return scalars, {**tiled, **per_row}, {}


def forward(
    blocks,
    pos,
    q,
    k,
    v,
    *,
    block: int,
    backend: str,
    block_sizes: be.BlockSizes,
    options: BlockKernelOptions = DEFAULT,
    bits=None,
    used=None,
    prefetch: bool | None = None,
):
    """Each tile row's partial (o [B,K,X,L,D] of ``options.partial_dtype``, lse [B,K,X,L,1] float32)
    over its tile's span. ``prefetch``: the tile spans (and ``used``) by scalar prefetch and the K/V
    span by index map (default: on TPU only; the interpreter runs both ways). ``bits`` with
    ``blocks_per_tile`` > 1, ``used`` with ``skip_padding_tiles`` (module docstring's layout)."""
    scalars, tiled, whole = _operands(options, blocks, used, pos, bits, {"q": q})
    outs = {"o": (*pos.shape[:4], q.shape[-1]), "lse": pos.shape}
    kw = dict(block=block, options=options, backend=backend, block_sizes=block_sizes, prefetch=prefetch)
    return _call(_forward_kernel, "block_sparse_attention_fwd", scalars, tiled, whole, k, v, outs, **kw)


def backward(
    blocks,
    pos,
    q,
    k,
    v,
    do,
    lse,
    delta,
    *,
    block: int,
    backend: str,
    block_sizes: be.BlockSizes,
    options: BlockKernelOptions = DEFAULT,
    bits=None,
    used=None,
    prefetch: bool | None = None,
):
    """Each tile's (dq rows [B,K,X,L,D], dk [B,K,X,W,D], dv [B,K,X,W,D]) of ``options.partial_dtype``,
    ``forward``'s layout; do like q, lse and delta like pos (gather_in_kernel: [B,K,T G])."""
    scalars, tiled, whole = _operands(options, blocks, used, pos, bits, {"q": q, "do": do, "lse": lse, "delta": delta})
    d, span = q.shape[-1], block * options.blocks_per_tile
    outs = {"dq": (*pos.shape[:4], d), "dk": (*pos.shape[:3], span, d), "dv": (*pos.shape[:3], span, d)}
    kw = dict(block=block, options=options, backend=backend, block_sizes=block_sizes, prefetch=prefetch)
    return _call(_backward_kernel, "block_sparse_attention_bwd", scalars, tiled, whole, k, v, outs, **kw)
