"""Small, obviously correct references: dense [T, T] masks and materialised rung keys.

Nothing here is fast; everything here is easy to check by eye against the paper's definitions.
Nothing here comes from the library either (rung lists and skip rules are written out again), so
a wrong rung in the library cannot move the reference with it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def _wide(x):
    """float32, or float64 when a test enables x64 (for finite differences)."""
    return x.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


# Forward / gradient tolerances per input dtype (atol, rtol), against this oracle in float32.
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
GRAD_TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=8e-2, rtol=8e-2)}


def distance_mask(t: int, distances) -> np.ndarray:
    """allowed[i, j] = (i - j) in distances and j <= i."""
    diff = np.arange(t)[:, None] - np.arange(t)[None, :]
    return np.isin(diff, list(distances)) & (diff >= 0)


def band_mask(t: int, window: int, sinks: int = 0) -> np.ndarray:
    """allowed[i, j] = j <= i and (i - j < window (the last W keys, itself included) or j < sinks)."""
    diff = np.arange(t)[:, None] - np.arange(t)[None, :]
    return (diff >= 0) & ((diff < window) | (np.arange(t)[None, :] < sinks))


def masked_attention(q, k, v, allowed_TT, *, q_other=None, other_TT=None):
    """Softmax attention restricted to allowed[i, j]; GQA by repeating K/V heads. The scores where
    other[i, j] are q_other's (the sinks kind scores its sinks with queries of their own)."""
    h, kh = q.shape[2], k.shape[2]
    k = jnp.repeat(_wide(k), h // kh, axis=2)
    v = jnp.repeat(_wide(v), h // kh, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", _wide(q), k, precision="highest") / math.sqrt(q.shape[-1])
    if q_other is not None:
        s = jnp.where(other_TT, jnp.einsum("bihd,bjhd->bhij", _wide(q_other), k, precision="highest") / math.sqrt(q.shape[-1]), s)
    s = jnp.where(allowed_TT, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bhij,bjhd->bihd", p, v, precision="highest")
    return out, jnp.transpose(lse, (0, 2, 1))


def rung_list(base, t: int, max_rung: int = 0) -> list[int]:
    """f_1..f_K by the paper: the 15 Fibonacci numbers 1, 2, 3, 5, ..., 987, every power of two
    <= T-1 ("pow2", reach-matched at the run length T), or the given list; with ``max_rung``,
    only the rungs <= it."""
    if base == "fibonacci":
        rungs = [1, 2]
        while len(rungs) < 15:
            rungs.append(rungs[-1] + rungs[-2])
    elif base == "pow2":
        rungs = [2**j for j in range(t.bit_length()) if 2**j <= t - 1]
    else:
        rungs = list(base)
    return [f for f in rungs if not max_rung or f <= max_rung]


def active_rungs(*, window: int, base, alpha: float, t: int, max_rung: int = 0) -> list[tuple[int, int]]:
    """(f, lo) of each active rung of the learned path, by the definition (paper A, "The learned
    path", and the reference's reading of "used" in BUILD_NOTES.md): lo = floor(alpha*f); a rung is
    skipped if round(alpha*f) <= W, if lo > T-1, or if lo is taken: by the window {0..min(W, T-1)}
    or by an earlier rung (first wins)."""
    taken = set(range(min(window, t - 1) + 1))
    active = []
    for f in rung_list(base, t, max_rung):
        lo = math.floor(alpha * f)
        if round(alpha * f) > window and lo <= t - 1 and lo not in taken:
            taken.add(lo)
            active.append((f, lo))
    return active


def learned_attention(q, k, v, *, window, base, alpha, alpha_value=None, max_rung=0):
    """The reference's materialised learned path: one interpolated key/value per rung.

    The active rung set is computed on the host from ``alpha_value`` (default ``alpha``, which
    may then be traced for gradients); lo is a host constant and frac = alpha*f - lo stays
    differentiable in alpha, as in the reference.
    """
    alpha_value = float(alpha if alpha_value is None else alpha_value)
    b, t, h, d = q.shape
    kh = k.shape[2]
    k = jnp.repeat(_wide(k), h // kh, axis=2)
    v = jnp.repeat(_wide(v), h // kh, axis=2)
    pos = np.arange(t)
    cols_k, cols_v, valid_from = [], [], []
    for dist in range(min(window, t - 1) + 1):
        idx = np.maximum(pos - dist, 0)
        cols_k.append(k[:, idx])
        cols_v.append(v[:, idx])
        valid_from.append(dist)
    for f, lo in active_rungs(window=window, base=base, alpha=alpha_value, t=t, max_rung=max_rung):
        frac = alpha * f - lo
        near, far = np.maximum(pos - lo, 0), np.maximum(pos - lo - 1, 0)
        cols_k.append((1 - frac) * k[:, near] + frac * k[:, far])
        cols_v.append((1 - frac) * v[:, near] + frac * v[:, far])
        valid_from.append(lo)
    kc, vc = jnp.stack(cols_k, 2), jnp.stack(cols_v, 2)  # [B, T, C, H, D]
    s = jnp.einsum("bthd,btchd->bthc", _wide(q), kc, precision="highest") / math.sqrt(d)
    valid = pos[:, None] >= np.asarray(valid_from)[None, :]
    s = jnp.where(valid[None, :, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bthc,btchd->bthd", p, vc, precision="highest"), lse


def random_qkv(key, b, t, h, kh, d, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype),
        jax.random.normal(kk, (b, t, kh, d), jnp.float32).astype(dtype),
        jax.random.normal(kv, (b, t, kh, d), jnp.float32).astype(dtype),
    )
