"""The offset paths (static and learned alpha) as XLA programs: the CPU default.

Every query reads the same shifted rows of K/V, so nothing here is ever [T, T]:

* the window {0..W} is a *band*: queries in blocks of C, each block against the C + W keys
  that end at it, as one small batched matmul per block (then masked to the band);
* every other attended distance is a *slot*: a shifted view x[i - d] of the whole sequence,
  scored with a multiply-reduce over D. A learned rung is a slot whose shift lo is traced,
  interpolated with its far neighbour: (1-frac) x[i-lo] + frac x[max(i-lo-1, 0)], blended before
  the read when the call is only evaluated, read as two taps when it is differentiated.

Band and slot scores share one float32 softmax. The formulation was chosen by measurement
over an index gather and over slots-only: BUILD_NOTES.md, "Offsets in XLA (static)".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention import offsets
from fibjax.attention.common import Array, finish, group_queries, masked_softmax, stats_dtype

BAND_BLOCK = 32


# --- shifted views ------------------------------------------------------------------------


def _rows_down(x_BTKD: Array, d) -> Array:
    """x[:, i - d] where i >= d, zeros above: one row gather."""
    i_T = jnp.arange(x_BTKD.shape[1])
    rows = jnp.take(x_BTKD, jnp.maximum(i_T - d, 0), axis=1, mode="clip")
    return jnp.where((i_T >= d)[None, :, None, None], rows, 0)


def _rows_up(g_BTKD: Array, d) -> Array:
    """The transpose of ``_rows_down``: g[:, j + d] where j + d < T, zeros below."""
    t = g_BTKD.shape[1]
    i_T = jnp.arange(t)
    rows = jnp.take(g_BTKD, jnp.minimum(i_T + d, t - 1), axis=1, mode="clip")
    return jnp.where((i_T + d < t)[None, :, None, None], rows, 0)


@jax.custom_vjp
def _shift(x_BTKD: Array, d) -> Array:
    """out[:, i] = x[:, i - d] for a distance d >= 0 known at trace time (an int < 2**31), zeros
    where i < d (those entries are masked). A row gather, and the gather that shifts up for the
    backward: on CPU both beat a pad and a slice, whose transpose was much of the static path's
    backward (BUILD_NOTES.md, "Offsets in XLA (static)", "Static shifts by a row gather"). d is an operand of the custom VJP (an int32
    inside it), so the gathers read computed indices; that is the program that was measured.
    Reverse mode only (no jvp). A traced shift keeps ``_shift_dynamic`` (gathers cost it
    memory)."""
    return _rows_down(x_BTKD, d)


def _shift_fwd(x_BTKD, d):
    return _rows_down(x_BTKD, d), d


def _shift_bwd(d, g_BTKD):
    return _rows_up(g_BTKD, d), None


_shift.defvjp(_shift_fwd, _shift_bwd)


@jax.custom_vjp
def _shift_dynamic(x_BTKD: Array, d: Array) -> Array:
    """``_shift`` by a traced d in [0, T-1]: one dynamic slice of a zero-padded copy."""
    t = x_BTKD.shape[1]
    padded = jnp.pad(x_BTKD, ((0, 0), (t, 0), (0, 0), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(padded, t - d, t, axis=1)


def _shift_dynamic_fwd(x_BTKD, d):
    return _shift_dynamic(x_BTKD, d), d


def _shift_dynamic_bwd(d, g_BTKD):
    # The transpose of "shift down by d" is "shift up by d", one more dynamic slice; XLA's own
    # transpose (a scatter into a zero buffer twice the size) made the learned path 25% slower.
    t = g_BTKD.shape[1]
    padded = jnp.pad(g_BTKD, ((0, 0), (0, t), (0, 0), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(padded, d, t, axis=1), None


_shift_dynamic.defvjp(_shift_dynamic_fwd, _shift_dynamic_bwd)


def _far_neighbour(near_BTKD: Array, lo: Array) -> Array:
    """x[max(i - lo - 1, 0)] from near = x[i - lo]: near one row earlier, except at i = lo where
    the clamp gives x[0] = near[lo]. One static shift instead of a second dynamic one (the
    learned path was 17% faster end to end when this was measured, before the figures of
    BUILD_NOTES.md, "Learned and interpolated offsets")."""
    t = near_BTKD.shape[1]
    at_lo_T = jnp.arange(t) == lo
    down_one = jnp.pad(near_BTKD, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :t]  # a pad, not _shift's gather: its VJP slowed this path
    return jnp.where(at_lo_T[None, :, None, None], near_BTKD, down_one)


def _blend(x_BTKD: Array, frac, dtype) -> Array:
    """m[j] = (1 - frac) x[j] + frac x[max(j - 1, 0)] in ``dtype``: shifted by lo, the interpolated
    rung (1 - frac) x[i - lo] + frac x[max(i - lo - 1, 0)] (the clamp included)."""
    x = x_BTKD.astype(dtype)
    prev = jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)  # x[max(j - 1, 0)]
    return x + jnp.asarray(frac, dtype) * (prev - x)


def _interpolated_shift(x_BTKD: Array, lo: Array, frac: Array) -> Array:
    """A learned rung's keys or values at a traced (lo, frac), float32: blended once, then one
    dynamic shift, so the rung is read once, as a static distance is (XLA's CPU library fusions
    take each operand of a read as a whole buffer: two taps and a broadcast frac cost three)."""
    return _shift_dynamic(_blend(x_BTKD, frac, frac.dtype), lo)


def _mix(x_BTKD: Array, lo: int, frac: float) -> Array:
    """(1 - frac) x[i - lo] + frac x[max(i - lo - 1, 0)] for a static lo and frac: the blend
    m[j] = (1 - frac) x[j] + frac x[max(j - 1, 0)] shifted by lo, so one elementwise pass and one
    static shift, as a static distance costs one shift."""
    return _shift(_blend(x_BTKD, frac, x_BTKD.dtype), lo)


# --- the band (window) ----------------------------------------------------------------------


def _band_blocks(x_BTKD: Array, block: int, window: int) -> Array:
    """[B,T,K,D] -> [B,N,W+C,K,D]: block n holds rows nC-W .. nC+C-1 (zeros before row 0)."""
    b, t, kh, d = x_BTKD.shape
    x_BNCKD = x_BTKD.reshape(b, t // block, block, kh, d)
    tail_BNWKD = jnp.pad(x_BNCKD[:, :-1, block - window :], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))
    return jnp.concatenate([tail_BNWKD, x_BNCKD], axis=2)


def _band_valid(t: int, block: int, window: int) -> np.ndarray:
    """valid[i, j] for query i and band column j (key i - i%C - W + j): 0 <= distance <= W, key >= 0."""
    i = np.arange(t)[:, None]
    key = i - i % block - window + np.arange(window + block)[None, :]
    return (key >= 0) & (i - key >= 0) & (i - key <= window)


def _band_scores(q_BTKGD: Array, k_BTKD: Array, block: int, window: int) -> Array:
    b, t, kh, g, d = q_BTKGD.shape
    q_BNCKGD = q_BTKGD.reshape(b, t // block, block, kh, g, d)
    s = jnp.einsum("bnckgd,bnjkd->bnckgj", q_BNCKGD, _band_blocks(k_BTKD, block, window), preferred_element_type=stats_dtype(q_BTKGD))
    return s.reshape(b, t, kh, g, window + block)


def _band_values(p_BTKGJ: Array, v_BTKD: Array, block: int, window: int) -> Array:
    b, t, kh, g, j = p_BTKGJ.shape
    p_BNCKGJ = p_BTKGJ.reshape(b, t // block, block, kh, g, j)
    o = jnp.einsum("bnckgj,bnjkd->bnckgd", p_BNCKGJ, _band_blocks(v_BTKD, block, window).astype(p_BTKGJ.dtype))
    return o.reshape(b, t, kh, g, -1)


# --- slots ------------------------------------------------------------------------------


def _slot_scores(q_BTKGD: Array, k_BTKD: Array) -> Array:
    return jnp.einsum("btkgd,btkd->btkg", q_BTKGD, k_BTKD, preferred_element_type=stats_dtype(q_BTKGD))


def _slot_values(p_BTKG: Array, v_BTKD: Array) -> Array:
    return jnp.einsum("btkg,btkd->btkgd", p_BTKG, v_BTKD.astype(p_BTKG.dtype))


class RungTaps(NamedTuple):
    """The taps of every rung slot at a traced alpha: shift lo [R] int32, frac [R], active [R] bool."""

    lo: Array
    frac: Array
    active: Array


def traced_rung_taps(alpha, rungs: Sequence[int], *, window: int, seq_len: int) -> RungTaps:
    """The reference's skip rules, vectorised over a fixed number of rung slots.

    A rung is active iff round(t) > W, lo > min(W, T-1) (not a window distance), lo <= T-1,
    and no earlier active rung has the same lo (first wins). Checking duplicates against
    earlier *candidates* is equivalent: a skipped candidate with that lo has an active
    predecessor with the same lo.
    """
    dtype = stats_dtype(jnp.asarray(alpha))
    t_R = jnp.asarray(alpha, dtype) * jnp.asarray(rungs, dtype)
    lo_R = jnp.floor(t_R)
    frac_R = t_R - lo_R  # d frac / d alpha = f: the gradient to alpha
    lo_R = lo_R.astype(jnp.int32)
    candidate_R = (jnp.round(t_R) > window) & (lo_R > min(window, seq_len - 1)) & (lo_R <= seq_len - 1)
    n = len(rungs)
    earlier_RR = np.arange(n)[None, :] < np.arange(n)[:, None]
    dup_R = jnp.any(earlier_RR & candidate_R[None, :] & (lo_R[None, :] == lo_R[:, None]), axis=1)
    return RungTaps(jnp.clip(lo_R, 0, seq_len - 1), frac_R, candidate_R & ~dup_R)


# --- the shared program --------------------------------------------------------------------


def _sparse_attention(
    q,
    k,
    v,
    *,
    window: int | None,
    distances: Sequence[int],
    rungs: RungTaps | None,
    seq_len: int,
    return_lse: bool,
    fixed_rungs: Sequence[tuple[int, float]] = (),
    blend_rungs: bool = True,
):
    """Band {0..window} (None: no band) + static slots at ``distances`` + learned ``rungs`` +
    ``fixed_rungs``: interpolated rungs (lo, frac) of a known alpha, whose keys and values are
    mixed once with static shifts (one slot each, as cheap as a static distance)."""
    block = BAND_BLOCK if window is None else max(BAND_BLOCK, -(-window // 8) * 8)
    t_pad = -(-seq_len // block) * block
    if t_pad != seq_len:  # padded queries are dropped; padded keys are later than every real query
        pad = ((0, 0), (0, t_pad - seq_len), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    q_BTKGD = group_queries(q, k.shape[2])
    pos_T = np.arange(t_pad)

    scores, valid = [], []
    if window is not None:
        scores.append(_band_scores(q_BTKGD, k, block, window))
        valid.append(jnp.asarray(_band_valid(t_pad, block, window)))
    for d in distances:
        scores.append(_slot_scores(q_BTKGD, _shift(k, d))[..., None])
        valid.append(jnp.asarray(pos_T >= d)[:, None])
    mixed_k = [_mix(k, lo, frac) for lo, frac in fixed_rungs]
    for (lo, _), k_mix in zip(fixed_rungs, mixed_k):
        scores.append(_slot_scores(q_BTKGD, k_mix)[..., None])
        valid.append(jnp.asarray(pos_T >= lo)[:, None])
    if rungs is not None:
        for lo, frac, active in zip(*rungs):
            if blend_rungs:
                scores.append(_slot_scores(q_BTKGD, _interpolated_shift(k, lo, frac))[..., None])
            else:
                k_near = _shift_dynamic(k, lo)
                near, far = _slot_scores(q_BTKGD, k_near), _slot_scores(q_BTKGD, _far_neighbour(k_near, lo))
                scores.append((near + frac * (far - near))[..., None])  # the score is linear in the key
            valid.append(((pos_T >= lo) & active)[:, None])
    if not scores:  # no distance is short enough for this length: every row is empty
        scores, valid = [_slot_scores(q_BTKGD, k)[..., None]], [jnp.zeros((t_pad, 1), bool)]
    p_BTKGS, lse_BTKG = masked_softmax(jnp.concatenate(scores, -1), jnp.concatenate(valid, -1)[None, :, None, None, :])

    col, o_BTKGD = 0, jnp.zeros(q_BTKGD.shape, p_BTKGS.dtype)
    if window is not None:
        o_BTKGD += _band_values(p_BTKGS[..., : window + block], v, block, window)
        col = window + block
    for d in distances:
        o_BTKGD += _slot_values(p_BTKGS[..., col], _shift(v, d))
        col += 1
    for lo, frac in fixed_rungs:
        o_BTKGD += _slot_values(p_BTKGS[..., col], _mix(v, lo, frac))
        col += 1
    if rungs is not None:
        for lo, frac, _ in zip(*rungs):
            if blend_rungs:
                o_BTKGD += _slot_values(p_BTKGS[..., col], _interpolated_shift(v, lo, frac))
            else:
                p_BTKG, v_near = p_BTKGS[..., col], _shift_dynamic(v, lo)
                o_BTKGD += _slot_values(p_BTKG * (1 - frac), v_near) + _slot_values(p_BTKG * frac, _far_neighbour(v_near, lo))
            col += 1
    return finish(o_BTKGD, lse_BTKG, q[:, :seq_len], return_lse)


@functools.partial(jax.jit, static_argnames=("distances", "return_lse"))
def offset_attention_xla(q: Array, k: Array, v: Array, *, distances: Sequence[int], return_lse: bool = False):
    """Static path. ``distances``: sorted unique ints; a leading run 0..W becomes the band."""
    t = q.shape[1]
    usable = [d for d in distances if d < t]  # longer distances are never valid at this length
    run = 0
    while run < len(usable) and usable[run] == run:
        run += 1
    window = run - 1 if run else None
    return _sparse_attention(q, k, v, window=window, distances=usable[run:], rungs=None, seq_len=t, return_lse=return_lse)


def _learned(q, k, v, alpha, window: int, base, return_lse: bool, blend_rungs: bool):
    t = q.shape[1]
    bases = offsets.rung_slots(window=window, base=base, seq_len=t)
    rungs = traced_rung_taps(alpha, bases, window=window, seq_len=t) if bases else None
    return _sparse_attention(q, k, v, window=min(window, t - 1), distances=(), rungs=rungs, seq_len=t, return_lse=return_lse, blend_rungs=blend_rungs)


# The two formulations of a learned rung win on different sides (BUILD_NOTES.md, "Learned and interpolated offsets"):
# blended keys and values read once (forward), near and far taps read apiece (backward, whose
# alpha gradient then comes from [T, K, G] scores instead of [T, K, D] rows). A custom VJP gives
# each its side: a call that is only evaluated runs the blended program, a differentiated call
# runs the two-tap program and its own VJP.
_learned_both = jax.custom_vjp(functools.partial(_learned, blend_rungs=True), nondiff_argnums=(4, 5, 6))


def _learned_both_fwd(q, k, v, alpha, window, base, return_lse):
    return jax.vjp(lambda *a: _learned(*a, window, base, return_lse, blend_rungs=False), q, k, v, alpha)


def _learned_both_bwd(window, base, return_lse, vjp, cotangent):
    return vjp(cotangent)


_learned_both.defvjp(_learned_both_fwd, _learned_both_bwd)


@functools.partial(jax.jit, static_argnames=("window", "base", "return_lse"))
def interpolated_attention_xla(q: Array, k: Array, v: Array, *, window: int, base, alpha, return_lse: bool = False):
    """Learned path: band {0..W} plus one interpolated slot per rung that alpha in [0.5, 1.5] can activate."""
    return _learned_both(q, k, v, jnp.asarray(alpha), window, base, return_lse)


def frozen_rungs(alpha: float, base, *, window: int, seq_len: int, dtype=jnp.float32) -> tuple[tuple[int, float], ...]:
    """(lo, frac) of every active rung for a known alpha, computed by ``traced_rung_taps`` itself
    (in ``dtype``, the same skip rules) so the frozen path attends exactly what the traced one does."""
    bases = offsets.rung_slots(window=window, base=base, seq_len=seq_len)
    if not bases:
        return ()
    with jax.ensure_compile_time_eval():
        lo_R, frac_R, active_R = jax.device_get(traced_rung_taps(jnp.asarray(alpha, dtype), bases, window=window, seq_len=seq_len))
    return tuple((int(lo), float(frac)) for lo, frac, on in zip(lo_R, frac_R, active_R) if on)


@functools.partial(jax.jit, static_argnames=("window", "base", "alpha", "return_lse"))
def frozen_interpolated_attention_xla(q: Array, k: Array, v: Array, *, window: int, base, alpha: float, return_lse: bool = False):
    """The learned path at a known alpha (inference after training): the same rungs and weights,
    compiled as constants, so each rung is one slot with static shifts instead of a traced one."""
    t = q.shape[1]
    fixed = frozen_rungs(alpha, base, window=window, seq_len=t, dtype=stats_dtype(q))
    return _sparse_attention(q, k, v, window=min(window, t - 1), distances=(), rungs=None, seq_len=t, return_lse=return_lse, fixed_rungs=fixed)
