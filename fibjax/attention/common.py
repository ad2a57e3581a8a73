"""Pieces every attention path shares: argument checks, head grouping, the masked softmax.

Shape letters (docs/design.md "Principles"): B batch, T sequence, H query heads, K key/value heads,
G = H // K query heads per KV head, D head dim, S attended slots, J keys of a band block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def check_qkv(q: Array, k: Array, v: Array) -> None:
    """Raise ValueError unless q [B,T,H,D] and k, v [B,T,K,D] with H % K == 0."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D [batch, seq, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch, seq or head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q_heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]})")


def stats_dtype(x: Array):
    """Softmax statistics dtype: float32, or wider when the inputs are (x64 tests)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def group_queries(q_BTHD: Array, num_kv_heads: int) -> Array:
    """[B,T,H,D] -> [B,T,K,G,D], pre-scaled by 1/sqrt(D)."""
    b, t, h, d = q_BTHD.shape
    return (q_BTHD * (1.0 / math.sqrt(d))).astype(q_BTHD.dtype).reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def masked_softmax(s_XS: Array, valid_XS: Array) -> tuple[Array, Array]:
    """Softmax over the last axis in the scores' dtype; rows with no valid entry: p = 0, lse = -inf."""
    s_XS = jnp.where(valid_XS, s_XS, -jnp.inf)
    m_X = jnp.max(s_XS, axis=-1)
    # m cancels in p and in lse = m + log(l), so its gradient path can be cut
    m_X = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_X), m_X, 0.0))
    e_XS = jnp.exp(s_XS - m_X[..., None])
    l_X = jnp.sum(e_XS, axis=-1)
    nonempty_X = l_X > 0
    l_safe_X = jnp.where(nonempty_X, l_X, 1.0)
    lse_X = jnp.where(nonempty_X, m_X + jnp.log(l_safe_X), -jnp.inf)
    return e_XS / l_safe_X[..., None], lse_X


def finish(o_BTKGD: Array, lse_BTKG: Array, q_BTHD: Array, return_lse: bool):
    """Back to [B,T,H,D] in q's dtype (and lse [B,T,H] if asked)."""
    b, t, h, d = q_BTHD.shape
    out_BTHD = o_BTKGD[:, :t].reshape(b, t, h, d).astype(q_BTHD.dtype)
    return (out_BTHD, lse_BTKG[:, :t].reshape(b, t, h)) if return_lse else out_BTHD
