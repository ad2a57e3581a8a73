"""The Pallas row-walk kernels of block-sparse attention: forward and dq, each query row walking its S blocks.

A query chooses its own blocks (``block_sparse``), so two rows of a program rarely read the same
key block: the kernels walk one row at a time, and for each of the row's S slots read the
block's J keys and values as a dynamic slice of the (batch, KV head)'s keys, all G query heads
of the KV head at once (GQA). The forward folds the block into the row's online softmax; dq
recomputes p = exp(s - lse) from the forward's lse and adds ds k (flash attention's backward,
one row). A slot's block index is a scalar the kernel reads (on TPU from SMEM, the way
scalar-prefetched indices are read). The own block (slot 0) is masked causally (key <= t); an
empty slot (-1) is skipped. dk/dv walk the same pairs the other way: ``block_bwd``.

Layout (``block_ops`` builds it; T padded to a multiple of the row block C):
q, do      [B, K, G, T, D]   queries grouped under their KV head
k, v       [B, K, T, D]
blocks     [B, K, T, S]      int32, each query's blocks (slot 0 its own; -1 empty)
lse, delta [B, K, G, T]      float32 (delta = rowsum(do * o) - d lse)
out: o, dq [B, K, G, T, D] in q's dtype, lse [B, K, G, T] float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fibjax.attention.pallas import backend as be

F32 = jnp.float32


def row_of(ref, t, group: int):
    """Row t of a [G, T, D] ref as [G, D] float32, or of a [G, T] ref as [G]."""
    if len(ref.shape) == 2:
        return ref[:, pl.ds(t, 1)].reshape(group).astype(F32)
    return ref[:, pl.ds(t, 1), :].reshape(group, ref.shape[-1]).astype(F32)


def dots(x_GD, y_JD):
    """[G, J] = x y^T as a multiply-reduce (a [G, D] x [D, J] product too small for a matmul unit)."""
    return jnp.sum(x_GD[:, None, :] * y_JD[None, :, :], axis=-1)


def block_keys(k_ref, v_ref, start, block: int):
    """K and V rows [start, start + J) in float32."""
    return k_ref[pl.ds(start, block), :].astype(F32), v_ref[pl.ds(start, block), :].astype(F32)


def _slot_visible(n, t, block: int):
    """[1, J]: slot block n (-1: empty) holds key n J + j visible to query t (its start, clamped)."""
    start = jnp.maximum(n, 0) * block
    key_J = start + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    return start, ((n >= 0) & (key_J <= t))[None, :]


def _forward_kernel(blocks_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block: int, slots: int, scale: float):
    group, rows, d = q_ref.shape
    i0 = pl.program_id(2) * rows

    def row(r, carry):
        t = i0 + r
        q_GD = row_of(q_ref, r, group) * scale

        def slot(s, state):
            m_G, l_G, acc_GD = state
            start, visible_1J = _slot_visible(blocks_ref[r, s], t, block)
            k_JD, v_JD = block_keys(k_ref, v_ref, start, block)
            s_GJ = jnp.where(visible_1J, dots(q_GD, k_JD), -jnp.inf)
            new_m_G = jnp.maximum(m_G, jnp.max(s_GJ, axis=-1))
            safe_m_G = jnp.where(new_m_G == -jnp.inf, 0.0, new_m_G)  # nothing seen yet: avoid inf - inf
            p_GJ = jnp.exp(s_GJ - safe_m_G[:, None])
            corr_G = jnp.exp(m_G - safe_m_G)
            acc_GD = acc_GD * corr_G[:, None] + jnp.sum(p_GJ[:, :, None] * v_JD[None, :, :], axis=1)
            return new_m_G, l_G * corr_G + jnp.sum(p_GJ, axis=-1), acc_GD

        init = (jnp.full((group,), -jnp.inf, F32), jnp.zeros((group,), F32), jnp.zeros((group, d), F32))
        m_G, l_G, acc_GD = jax.lax.fori_loop(0, slots, slot, init)
        nonempty_G = l_G > 0
        safe_l_G = jnp.where(nonempty_G, l_G, 1.0)
        o_ref[:, pl.ds(r, 1), :] = (acc_GD / safe_l_G[:, None]).reshape(group, 1, d).astype(o_ref.dtype)
        lse_ref[:, pl.ds(r, 1)] = jnp.where(nonempty_G, m_G + jnp.log(safe_l_G), -jnp.inf).reshape(group, 1)
        return carry

    jax.lax.fori_loop(0, rows, row, 0)


def _dq_kernel(blocks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block: int, slots: int, scale: float):
    group, rows, d = q_ref.shape
    i0 = pl.program_id(2) * rows

    def row(r, carry):
        t = i0 + r
        q_GD, do_GD = row_of(q_ref, r, group) * scale, row_of(do_ref, r, group)
        lse_G1, delta_G1 = row_of(lse_ref, r, group)[:, None], row_of(delta_ref, r, group)[:, None]

        def slot(s, dq_GD):
            start, visible_1J = _slot_visible(blocks_ref[r, s], t, block)
            k_JD, v_JD = block_keys(k_ref, v_ref, start, block)
            # select, never multiply: a row with no key has lse = -inf and exp(s - lse) = inf
            p_GJ = jnp.where(visible_1J, jnp.exp(dots(q_GD, k_JD) - lse_G1), 0.0)
            ds_GJ = p_GJ * (dots(do_GD, v_JD) - delta_G1)
            return dq_GD + jnp.sum(ds_GJ[:, :, None] * k_JD[None, :, :], axis=1)

        dq_GD = jax.lax.fori_loop(0, slots, slot, jnp.zeros((group, d), F32))
        dq_ref[:, pl.ds(r, 1), :] = (dq_GD * scale).reshape(group, 1, d).astype(dq_ref.dtype)
        return carry

    jax.lax.fori_loop(0, rows, row, 0)


def _row_specs(q, blocks, backend: str, rows: int):
    """(blocks, query rows, whole K/V, lse rows) BlockSpecs of a grid (B, K, T / rows)."""
    _, _, g, t, d = q.shape
    s = blocks.shape[-1]
    # the kernel reads a row's block indices as scalars: SMEM on TPU
    smem = dict(memory_space=pltpu.SMEM) if backend == "mosaic_tpu" else {}
    return (
        pl.BlockSpec((None, None, rows, s), lambda b, h, i: (b, h, i, 0), **smem),
        pl.BlockSpec((None, None, g, rows, d), lambda b, h, i: (b, h, 0, i, 0)),
        pl.BlockSpec((None, None, t, d), lambda b, h, i: (b, h, 0, 0)),
        pl.BlockSpec((None, None, g, rows), lambda b, h, i: (b, h, 0, i)),
    )


def forward(q, k, v, blocks, *, block: int, backend: str, block_sizes: be.BlockSizes):
    """o [B,K,G,T,D] (q's dtype), lse [B,K,G,T] float32 of q [B,K,G,T,D] (unscaled), k/v [B,K,T,D],
    blocks [B,K,T,S] int32; T a multiple of ``block_sizes.block_q`` (query rows per program)."""
    b, kh, g, t, d = q.shape
    rows = block_sizes.block_q
    blocks_spec, row_spec, whole_kv, lse_spec = _row_specs(q, blocks, backend, rows)
    kernel = functools.partial(_forward_kernel, block=block, slots=blocks.shape[-1], scale=d**-0.5)
    return be.call(
        kernel,
        backend=backend,
        block_sizes=block_sizes,
        grid=(b, kh, t // rows),
        in_specs=[blocks_spec, row_spec, whole_kv, whole_kv],
        out_specs=[row_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kh, g, t), F32)],
        name="block_sparse_attention_fwd",
    )(blocks, q, k, v)


def dq(q, k, v, do, lse, delta, blocks, *, block: int, backend: str, block_sizes: be.BlockSizes):
    """dq [B,K,G,T,D] in q's dtype: ``forward``'s layout, do like q, lse and delta [B,K,G,T] float32."""
    b, kh, _, t, d = q.shape
    rows = block_sizes.block_q
    blocks_spec, row_spec, whole_kv, lse_spec = _row_specs(q, blocks, backend, rows)
    kernel = functools.partial(_dq_kernel, block=block, slots=blocks.shape[-1], scale=d**-0.5)
    return be.call(
        kernel,
        backend=backend,
        block_sizes=block_sizes,
        grid=(b, kh, t // rows),
        in_specs=[blocks_spec, row_spec, whole_kv, whole_kv, row_spec, lse_spec, lse_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="block_sparse_attention_dq",
    )(blocks, q, k, v, do, lse, delta)
