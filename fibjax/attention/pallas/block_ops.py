"""Block-sparse attention on Pallas kernels, forward and backward: layout and custom VJP.

Same semantics, arguments and return values as ``block_sparse.block_sparse_attention_xla`` (the
choice is the same XLA code, ``block_sparse._chosen_blocks``); the kernels attend: the forward
and dq walk each query's blocks (``block_kernels``), dk/dv each block's queries (``block_bwd``,
which builds that inverse map in XLA). Gradients are flash attention's, from the forward's lse.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax.attention.block_sparse import _chosen_blocks, _pad_to, num_earlier_blocks
from fibjax.attention.common import Array
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas import block_bwd, block_kernels


class _Spec(NamedTuple):
    """Everything static about one call (hashable: a ``nondiff_argnums`` argument)."""

    block: int  # keys per block (J)
    seq_len: int
    block_sizes: be.BlockSizes  # block_q: query rows per program; block_k: pairs per dk/dv program
    backend: str

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block)

    @property
    def padded_len(self) -> int:
        """T rounded up to whole key blocks, then to whole programs."""
        return -(-self.num_blocks * self.block // self.block_sizes.block_q) * self.block_sizes.block_q

    def kwargs(self) -> dict:
        return dict(block=self.block, backend=self.backend, block_sizes=self.block_sizes)


def _queries_to_kernel(x_BTHD: Array, num_kv: int, tp: int) -> Array:
    """[B,T,H,D] -> [B,K,G,T',D], zero rows after the sequence."""
    b, _, h, d = x_BTHD.shape
    return jnp.transpose(_pad_to(x_BTHD, tp).reshape(b, tp, num_kv, h // num_kv, d), (0, 2, 3, 1, 4))


def _rows_to_kernel(x_BTH: Array, num_kv: int, tp: int) -> Array:
    """[B,T,H] -> [B,K,G,T'] (delta), zeros after the sequence."""
    return _queries_to_kernel(x_BTH[..., None], num_kv, tp)[..., 0]


def _queries_from_kernel(x_BKGTD: Array, t: int) -> Array:
    b, kh, g, tp, d = x_BKGTD.shape
    return jnp.transpose(x_BKGTD, (0, 3, 1, 2, 4)).reshape(b, tp, kh * g, d)[:, :t]


def _keys_from_kernel(x_BKTD: Array, t: int) -> Array:
    return jnp.swapaxes(x_BKTD[:, :, :t], 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    """(out [B,T,H,D], lse [B,T,H]) over the blocks ``idx_BKTS`` [B,K,T',S] (T' = T in whole blocks)."""
    return _attention_fwd(spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS)[0]


# The forward and the backward are each three stages, layout -> kernels -> merge, named so that
# ``fibjax.bench.phases`` times the very functions the path runs.
def fwd_layout(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    """The kernels' operands: q [B,K,G,T',D], k, v [B,K,T',D], blocks [B,K,T',S] (-1 past T)."""
    kh, tp = k_BTKD.shape[2], spec.padded_len
    k_BKTD, v_BKTD = (jnp.swapaxes(_pad_to(x, tp), 1, 2) for x in (k_BTKD, v_BTKD))
    blocks_BKTS = jnp.pad(idx_BKTS, ((0, 0), (0, 0), (0, tp - idx_BKTS.shape[2]), (0, 0)), constant_values=-1)
    return _queries_to_kernel(q_BTHD, kh, tp), k_BKTD, v_BKTD, blocks_BKTS


def fwd_kernels(spec: _Spec, q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS):
    """(out [B,K,G,T',D], lse [B,K,G,T'])."""
    return block_kernels.forward(q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS, **spec.kwargs())


def fwd_merge(spec: _Spec, o_BKGTD, lse_BKGT):
    """(out [B,T,H,D], lse [B,T,H])."""
    return _queries_from_kernel(o_BKGTD, spec.seq_len), _queries_from_kernel(lse_BKGT[..., None], spec.seq_len)[..., 0]


def _attention_fwd(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS):
    q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS = fwd_layout(spec, q_BTHD, k_BTKD, v_BTKD, idx_BKTS)
    o_BKGTD, lse_BKGT = fwd_kernels(spec, q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS)
    out_BTHD, lse_BTH = fwd_merge(spec, o_BKGTD, lse_BKGT)
    return (out_BTHD, lse_BTH), (q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS, out_BTHD, lse_BKGT)


def bwd_layout(spec: _Spec, residuals, cotangents):
    """(the dq kernel's operands, the dk/dv kernel's tiles: the inverse map)."""
    q_BKGTD, k_BKTD, v_BKTD, blocks_BKTS, out_BTHD, lse_BKGT = residuals
    do_BTHD, dlse_BTH = cotangents
    kh, tp = k_BKTD.shape[1], spec.padded_len
    # d lse / d s = p, so an lse cotangent enters exactly like -delta (FlashAttention's D term)
    delta_BTH = jnp.sum(do_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1) - dlse_BTH
    args = (q_BKGTD, k_BKTD, v_BKTD, _queries_to_kernel(do_BTHD, kh, tp), lse_BKGT, _rows_to_kernel(delta_BTH, kh, tp), blocks_BKTS)
    return args, block_bwd.tiles_of(blocks_BKTS, spec.num_blocks, spec.block_sizes.block_k)


def bwd_dq(spec: _Spec, args, tiles):
    """dq [B,K,G,T',D] float32 (the dq kernel)."""
    return block_kernels.dq(*args, **spec.kwargs())


def bwd_dkdv(spec: _Spec, args, tiles):
    """Each tile's (dk, dv) [B,K,X,J,D] float32 (the dk/dv kernel)."""
    return block_bwd.dkdv_partials(*args[:-1], tiles, **spec.kwargs())


def bwd_merge(spec: _Spec, dq_BKGTD, parts, tiles, kv_dtype):
    """(dq [B,T,H,D], dk, dv [B,T,K,D] in ``kv_dtype``): the tiles' partials summed per block."""
    t = spec.seq_len
    dk_BTKD, dv_BTKD = (_keys_from_kernel(block_bwd.per_block(p, tiles, spec.num_blocks), t).astype(kv_dtype) for p in parts)
    return _queries_from_kernel(dq_BKGTD, t), dk_BTKD, dv_BTKD


def _attention_bwd(spec: _Spec, residuals, cotangents):
    args, tiles = bwd_layout(spec, residuals, cotangents)
    return (*bwd_merge(spec, bwd_dq(spec, args, tiles), bwd_dkdv(spec, args, tiles), tiles, residuals[1].dtype), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_shapes(spec: _Spec, group: int, head_dim: int) -> None:
    """What the compilers take: Triton loads only power-of-two shapes ([G, D] query rows, [J, D]
    key blocks); on TPU the dk/dv kernel's [J, D] key block needs J a multiple of 8 (sublanes)."""
    if spec.backend == "triton":
        for name, x in (("block_size", spec.block), ("query heads per KV head", group), ("head_dim", head_dim)):
            if x & (x - 1):
                raise ValueError(f"the Triton block-sparse kernels need {name} a power of two, got {x}")
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
    """:func:`fibjax.attention.block_sparse_attention` (no argument checks) on the Pallas kernels;
    ``block_sizes.block_q`` query rows per forward / dq program, ``block_k`` pairs per dk/dv one."""
    t = q.shape[1]
    spec = _Spec(block_size, t, (block_sizes or be.BlockSizes()).fit(t), be.resolve(backend))
    _check_shapes(spec, q.shape[2] // k.shape[2], q.shape[3])
    top = num_earlier_blocks(t, block_size, num_blocks)
    idx_BKTS = _chosen_blocks(q, k, None, block=block_size, top=top, rule=block_rank, chunk=256)
    out, lse = _attention(spec, q, k, v, jax.lax.stop_gradient(idx_BKTS))
    return (out, lse) if return_lse else out
