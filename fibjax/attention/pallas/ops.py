"""Offset attention on Pallas kernels: layout, the custom VJP, the static and learned entry points.

Same semantics, layout and return values as ``fibjax.attention.offset_xla`` (the reference):
q [B,T,H,D], k/v [B,T,K,D] in, out in q's dtype and lse [B,T,H] float32 out. The kernels
see queries grouped under their KV head ([B,K,G,T,D]) and K/V zero-padded at both ends so
every shifted block read is in bounds (``kernels.py`` says why each pad is needed).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax.attention import offsets
from fibjax.attention.common import Array
from fibjax.attention.offset_xla import traced_rung_taps
from fibjax.attention.pallas import backend as be
from fibjax.attention.pallas import kernels


class _Spec(NamedTuple):
    """Everything static about one call (hashable: it is a ``nondiff_argnums`` argument)."""

    distances: tuple[int, ...]
    seq_len: int
    block_sizes: be.BlockSizes
    backend: str

    @property
    def pad(self) -> int:
        return max(self.block_sizes.block_q, self.block_sizes.block_k)

    @property
    def padded_len(self) -> int:
        return -(-self.seq_len // self.pad) * self.pad


def _queries_to_kernel(x_BTHD: Array, num_kv: int, spec: _Spec) -> Array:
    """[B,T,H,D] -> [B,K,G,T'+P,D]: grouped by KV head, zero rows after the sequence."""
    b, t, h, d = x_BTHD.shape
    x_BKGTD = x_BTHD.reshape(b, t, num_kv, h // num_kv, d).transpose(0, 2, 3, 1, 4)
    return jnp.pad(x_BKGTD, ((0, 0),) * 3 + ((0, spec.padded_len + spec.pad - t), (0, 0)))


def _rows_to_kernel(x_BTH: Array, num_kv: int, spec: _Spec) -> Array:
    """[B,T,H] -> [B,K,G,T'+P] (lse, delta)."""
    b, t, h = x_BTH.shape
    x_BKGT = x_BTH.reshape(b, t, num_kv, h // num_kv).transpose(0, 2, 3, 1)
    return jnp.pad(x_BKGT, ((0, 0),) * 3 + ((0, spec.padded_len + spec.pad - t),))


def _keys_to_kernel(x_BTKD: Array, spec: _Spec) -> Array:
    """[B,T,K,D] -> [B,K,P+T'+P,D]: P zero rows before (shifted reads) and after (the far-group read)."""
    t = x_BTKD.shape[1]
    return jnp.pad(x_BTKD.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (spec.pad, spec.padded_len - t + spec.pad), (0, 0)))


def _queries_from_kernel(x_BKGTD: Array, t: int) -> Array:
    b, kh, g, _, d = x_BKGTD.shape
    return x_BKGTD[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, d)


def _rows_from_kernel(x_BKGT: Array, t: int) -> Array:
    b, kh, g, _ = x_BKGT.shape
    return x_BKGT[..., :t].transpose(0, 3, 1, 2).reshape(b, t, kh * g)


def _kwargs(spec: _Spec) -> dict:
    return dict(distances=spec.distances, seq_len=spec.seq_len, pad=spec.pad, block_sizes=spec.block_sizes, backend=spec.backend)


def _kernel_rungs(rungs):
    """(lo, frac) as the kernels read them: int32 and float32 scalars."""
    return None if rungs is None else (rungs[0].astype(jnp.int32), rungs[1].astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, rungs):
    """(out [B,T,H,D], lse [B,T,H]); rungs None (static path) or (lo [R] int, frac [R] float)."""
    return _attention_fwd(spec, q_BTHD, k_BTKD, v_BTKD, rungs)[0]


def _attention_fwd(spec: _Spec, q_BTHD, k_BTKD, v_BTKD, rungs):
    kh, t = k_BTKD.shape[2], spec.seq_len
    q_BKGTD = _queries_to_kernel(q_BTHD, kh, spec)
    k_BKTD, v_BKTD = _keys_to_kernel(k_BTKD, spec), _keys_to_kernel(v_BTKD, spec)
    o_BKGTD, lse_BKGT = kernels.forward(q_BKGTD, k_BKTD, v_BKTD, _kernel_rungs(rungs), **_kwargs(spec))
    out = (_queries_from_kernel(o_BKGTD, t), _rows_from_kernel(lse_BKGT, t))
    return out, (q_BKGTD, k_BKTD, v_BKTD, out[0], lse_BKGT, rungs)


def _attention_bwd(spec: _Spec, residuals, cotangents):
    q_BKGTD, k_BKTD, v_BKTD, out_BTHD, lse_BKGT, rungs = residuals
    do_BTHD, dlse_BTH = cotangents
    kh, t = k_BKTD.shape[1], spec.seq_len
    # d lse / d s = p, so an lse cotangent enters exactly like -delta (FlashAttention's D term)
    delta_BTH = jnp.sum(do_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1) - dlse_BTH
    dq_BKGTD, dk_BKTD, dv_BKTD, dfrac_R = kernels.backward(
        q_BKGTD,
        k_BKTD,
        v_BKTD,
        _queries_to_kernel(do_BTHD, kh, spec),
        jnp.pad(lse_BKGT, ((0, 0),) * 3 + ((0, spec.pad),)),
        _rows_to_kernel(delta_BTH, kh, spec),
        _kernel_rungs(rungs),
        **_kwargs(spec),
    )
    dk_BTKD, dv_BTKD = (x[:, :, :t].transpose(0, 2, 1, 3) for x in (dk_BKTD, dv_BKTD))
    d_rungs = None if rungs is None else (None, dfrac_R.astype(rungs[1].dtype))  # lo: integer, no cotangent
    return _queries_from_kernel(dq_BKGTD, t), dk_BTKD, dv_BTKD, d_rungs


_attention.defvjp(_attention_fwd, _attention_bwd)


def _spec(q: Array, distances, block_sizes: be.BlockSizes | None, backend: str | None) -> _Spec:
    t = q.shape[1]
    return _Spec(tuple(distances), t, (block_sizes or be.BlockSizes()).fit(t), be.resolve(backend))


@functools.partial(jax.jit, static_argnames=("distances", "return_lse", "block_sizes", "backend"))
def offset_attention_pallas(
    q: Array, k: Array, v: Array, *, distances: Sequence[int], return_lse: bool = False, block_sizes: be.BlockSizes | None = None, backend: str | None = None
):
    """Static path: query i attends keys i - d for d in ``distances`` (sorted unique Python ints)."""
    usable = tuple(d for d in distances if d < q.shape[1])  # longer distances are never valid
    out, lse = _attention(_spec(q, usable, block_sizes, backend), q, k, v, None)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("window", "base", "return_lse", "block_sizes", "backend"))
def interpolated_attention_pallas(
    q: Array, k: Array, v: Array, *, window: int, base, alpha, return_lse: bool = False, block_sizes: be.BlockSizes | None = None, backend: str | None = None
):
    """Learned path: window {0..W} as static slots plus one runtime (lo, frac) slot per rung that
    alpha in [0.5, 1.5] can activate (``offset_xla.traced_rung_taps``: the same skip rules)."""
    t = q.shape[1]
    bases = offsets.rung_slots(window=window, base=base, seq_len=t)
    rungs = None
    if bases:
        lo, frac, active = traced_rung_taps(alpha, bases, window=window, seq_len=t)
        rungs = (jnp.where(active, lo, t), frac)  # lo = T: no query reaches an inactive rung
    out, lse = _attention(_spec(q, range(min(window, t - 1) + 1), block_sizes, backend), q, k, v, rungs)
    return (out, lse) if return_lse else out
