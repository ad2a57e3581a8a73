"""The Pallas forward kernel of block-sparse attention: each query row walks its S chosen blocks.

A query chooses its own blocks (``block_sparse``), so two rows of a program rarely read the same
key block: the kernel walks one row at a time, and for each of the row's S slots reads the
block's J keys and values as a dynamic slice of the (batch, KV head)'s keys and folds them into
the row's online softmax (all G query heads of the KV head at once: GQA). A slot's block index
is a scalar the kernel reads (on TPU from SMEM, the way scalar-prefetched indices are read).
The own block (slot 0) is masked causally; an empty slot (-1) is skipped.

Layout (``block_ops`` builds it; T padded to a multiple of the row block C):
q       [B, K, G, T, D]   queries grouped under their KV head
k, v    [B, K, T, D]
blocks  [B, K, T, S]      int32, each query's blocks (slot 0 its own; -1 empty)
out: o  [B, K, G, T, D] in q's dtype, lse [B, K, G, T] float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fibjax.attention.pallas import backend as be

F32 = jnp.float32


def _forward_kernel(blocks_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block: int, slots: int, scale: float):
    group, rows, d = q_ref.shape
    i0 = pl.program_id(2) * rows

    def row(r, carry):
        t = i0 + r
        q_GD = q_ref[:, pl.ds(r, 1), :].reshape(group, d).astype(F32) * scale

        def slot(s, state):
            m_G, l_G, acc_GD = state
            n = blocks_ref[r, s]
            start = jnp.maximum(n, 0) * block
            k_JD = k_ref[pl.ds(start, block), :].astype(F32)
            v_JD = v_ref[pl.ds(start, block), :].astype(F32)
            key_J = start + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
            visible_1J = ((n >= 0) & (key_J <= t))[None, :]
            s_GJ = jnp.where(visible_1J, jnp.sum(q_GD[:, None, :] * k_JD[None, :, :], axis=-1), -jnp.inf)
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


def forward(q, k, v, blocks, *, block: int, backend: str, block_sizes: be.BlockSizes):
    """o [B,K,G,T,D] (q's dtype), lse [B,K,G,T] float32 of q [B,K,G,T,D] (unscaled), k/v [B,K,T,D],
    blocks [B,K,T,S] int32; T a multiple of ``block_sizes.block_q`` (query rows per program)."""
    b, kh, g, t, d = q.shape
    rows = block_sizes.block_q
    s = blocks.shape[-1]
    grid = (b, kh, t // rows)
    row_spec = pl.BlockSpec((None, None, g, rows, d), lambda b, h, i: (b, h, 0, i, 0))
    whole_kv = pl.BlockSpec((None, None, t, d), lambda b, h, i: (b, h, 0, 0))
    blocks_spec = pl.BlockSpec((None, None, rows, s), lambda b, h, i: (b, h, i, 0))
    if backend == "mosaic_tpu":  # the kernel reads a row's block indices as scalars
        blocks_spec = pl.BlockSpec((None, None, rows, s), lambda b, h, i: (b, h, i, 0), memory_space=pltpu.SMEM)
    kernel = functools.partial(_forward_kernel, block=block, slots=s, scale=d**-0.5)
    return be.call(
        kernel,
        backend=backend,
        block_sizes=block_sizes,
        grid=grid,
        in_specs=[blocks_spec, row_spec, whole_kv, whole_kv],
        out_specs=[row_spec, pl.BlockSpec((None, None, g, rows), lambda b, h, i: (b, h, 0, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kh, g, t), F32)],
        name="block_sparse_attention_fwd",
    )(blocks, q, k, v)
