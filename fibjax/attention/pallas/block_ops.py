"""Block-sparse attention with the Pallas forward kernel (``block_kernels``): layout and custom VJP.

Same semantics, arguments and return values as ``block_sparse.block_sparse_attention_xla`` (the
choice is the same XLA code, ``block_sparse._chosen_blocks``); the kernel attends. The backward
is the XLA one of ``block_grouped`` (pairs grouped by key block) from the kernel's output and
lse: a Pallas backward is not written yet (BUILD_NOTES, "Block-sparse attention").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax.attention import block_grouped
from fibjax.attention.block_sparse import _chosen_blocks, _pad_to, num_earlier_blocks
from fibjax.attention.common import Array, group_queries
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas import block_kernels


class _Spec(NamedTuple):
    """Everything static about one call (hashable: a ``nondiff_argnums`` argument)."""

    block: int  # keys per block (J)
    seq_len: int
    block_sizes: be.BlockSizes  # block_q: query rows per program
    backend: str

    @property
    def padded_len(self) -> int:
        """T rounded up to whole key blocks, then to whole programs."""
        t_blocks = -(-self.seq_len // self.block) * self.block
        return -(-t_blocks // self.block_sizes.block_q) * self.block_sizes.block_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    """(out [B,T,H,D], lse [B,T,H]) over the blocks ``idx_BKTS`` [B,K,T',S] (T' = T in whole blocks)."""
    return _attention_fwd(spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS)[0]


def _attention_fwd(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    b, t, h, d = q_BTHD.shape
    kh, tp = k_BTKD.shape[2], spec.padded_len
    q_BKGTD = jnp.transpose(_pad_to(q_BTHD, tp).reshape(b, tp, kh, h // kh, d), (0, 2, 3, 1, 4))
    k_BKTD, v_BKTD = (jnp.swapaxes(_pad_to(x, tp), 1, 2) for x in (k_BTKD, v_BTKD))
    blocks_BKTS = jnp.pad(idx_BKTS, ((0, 0), (0, 0), (0, tp - idx_BKTS.shape[2]), (0, 0)), constant_values=-1)
    o_BKGTD, lse_BKGT = block_kernels.forward(q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS, block=spec.block, backend=spec.backend, block_sizes=spec.block_sizes)
    out = (jnp.transpose(o_BKGTD, (0, 3, 1, 2, 4)).reshape(b, tp, h, d)[:, :t], jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(b, tp, h)[:, :t])
    return out, (q_BTHD, k_BTKD, v_BTKD, idx_BKTS, *out)


def _attention_bwd(spec: _Spec, residuals, cotangents):
    q_BTHD, k_BTKD, v_BTKD, idx_BKTS, out_BTHD, lse_BTH = residuals
    b, t, h, d = q_BTHD.shape
    kh, t_blocks = k_BTKD.shape[2], idx_BKTS.shape[2]
    g = h // kh
    do_BTHD, dlse_BTH = cotangents
    pad = lambda x: jnp.pad(x, ((0, 0), (0, t_blocks - t)) + ((0, 0),) * (x.ndim - 2))
    q, k, v = (pad(x) for x in (q_BTHD, k_BTKD, v_BTKD))
    o_BTKGD, do_BTKGD = (pad(x.astype(jnp.float32)).reshape(b, t_blocks, kh, g, d) for x in (out_BTHD, do_BTHD))
    lse_BTKG, dlse_BTKG = (pad(x).reshape(b, t_blocks, kh, g) for x in (lse_BTH, dlse_BTH))
    layout = block_grouped.pair_layout(idx_BKTS, t_blocks // spec.block)
    residuals = (group_queries(q, kh), k, v, layout, o_BTKGD, lse_BTKG)
    dq, dk, dv, _ = block_grouped.backward(spec.block, block_grouped.TILE, block_grouped.CHUNK, residuals, (do_BTKGD, dlse_BTKG))
    dq = (dq.astype(jnp.float32) * (1.0 / math.sqrt(d))).reshape(b, t_blocks, h, d)[:, :t]
    return dq.astype(q_BTHD.dtype), dk[:, :t], dv[:, :t], None


_attention.defvjp(_attention_fwd, _attention_bwd)


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
    """:func:`fibjax.attention.block_sparse_attention` (no argument checks) with the Pallas
    forward kernel; ``block_sizes.block_q`` query rows per program."""
    t = q.shape[1]
    top = num_earlier_blocks(t, block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, None, block=block_size, top=top, rule=block_rank, chunk=256)
    spec = _Spec(block_size, t, (block_sizes or be.BlockSizes()).fit(t), be.resolve(backend))
    out, lse = _attention(spec, q, k, v, jax.lax.stop_gradient(idx_BKTS))
    return (out, lse) if return_lse else out
