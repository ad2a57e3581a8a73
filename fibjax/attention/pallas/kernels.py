"""The three Pallas kernels of offset attention: forward, dq (+ d frac), dk/dv.

Every attended distance is a contiguous shifted slice of K/V shared by all queries, so the
kernels never build a mask over [T, T]: a program owns a block of rows and, for each *slot*,
reads the shifted block and works row-wise (one key per query per slot: a multiply-reduce
over D, not a matmul). A slot is either a static distance d (a Python int: the window and
the static rungs) or a learned rung (lo, frac): runtime scalars, so alpha never recompiles.
A rung's key is (1-frac) K[i-lo] + frac K[max(i-lo-1, 0)], valid iff i >= lo; an inactive
rung arrives with lo = T, which no query reaches.

Kernel layout (built by ``ops.py``; T here is the padded length, P the pad, a block size):
q, do   [B, K, G, T+P, D]   queries grouped under their KV head; P zero rows at the end
k, v    [B, K, P+T+P, D]    P zero rows at both ends, so every shifted block is in bounds
lse, delta [B, K, G, T+P]   float32
Softmax statistics are float32 throughout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fibjax.attention.pallas import backend as be

F32 = jnp.float32


def _slots(distances, num_rungs, lo_ref, frac_ref):
    """(shift, frac) per slot: static distances (frac None), then the runtime rung slots."""
    return [(d, None) for d in distances] + [(lo_ref[r], frac_ref[r]) for r in range(num_rungs)]


def _load(ref, start, size, rows, shift, frac):
    """Rows [start, start+size) of a K/V ref in float32, as (x, far - x) for a rung slot.

    For a rung, far is the row before (key i-lo-1); the query i == lo has no such key and the
    reference clamps it to K[0], which is its near key, so far - x is 0 there.
    """
    if frac is None:
        return ref[pl.ds(jnp.maximum(start, 0), size), :].astype(F32), None
    start = jnp.maximum(start, 1)  # fully masked blocks only; keeps the far read in bounds
    near = ref[pl.ds(start, size), :].astype(F32)
    far = ref[pl.ds(start - 1, size), :].astype(F32)
    return near, jnp.where((rows == shift)[:, None], 0.0, far - near)


def _interp(x, diff, frac):
    return x if frac is None else x + frac * diff


def _rows(start, size):
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


# --- forward: a block of queries, an online softmax over the slots -------------------------


def _forward_kernel(*refs, distances, num_rungs, pad, seq_len, scale):
    lo_ref, frac_ref = refs[:2] if num_rungs else (None, None)
    q_ref, k_ref, v_ref, o_ref, lse_ref = refs[2:] if num_rungs else refs
    group, block, _ = q_ref.shape
    s0 = pl.program_id(2) * block
    rows = _rows(s0, block)
    q = [q_ref[g].astype(F32) * scale for g in range(group)]
    row_max = [jnp.full((block,), -jnp.inf, F32)] * group
    row_sum = [jnp.zeros((block,), F32)] * group
    acc = [jnp.zeros(q[0].shape, F32)] * group
    for shift, frac in _slots(distances, num_rungs, lo_ref, frac_ref):
        k = _interp(*_load(k_ref, pad + s0 - shift, block, rows, shift, frac), frac)
        v = _interp(*_load(v_ref, pad + s0 - shift, block, rows, shift, frac), frac)
        valid = (rows >= shift) & (rows < seq_len)
        for g in range(group):
            s = jnp.where(valid, jnp.sum(q[g] * k, axis=-1), -jnp.inf)
            new_max = jnp.maximum(row_max[g], s)
            safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # no key yet: avoid inf - inf
            corr, p = jnp.exp(row_max[g] - safe_max), jnp.exp(s - safe_max)
            row_sum[g] = row_sum[g] * corr + p
            acc[g] = acc[g] * corr[:, None] + p[:, None] * v
            row_max[g] = new_max
    for g in range(group):
        nonempty = row_sum[g] > 0  # a row with no valid key: zeros out, lse = -inf
        safe_sum = jnp.where(nonempty, row_sum[g], 1.0)
        o_ref[g] = (acc[g] / safe_sum[:, None]).astype(o_ref.dtype)
        lse_ref[g] = jnp.where(nonempty, row_max[g] + jnp.log(safe_sum), -jnp.inf)


# --- dq: the same walk, with p recomputed from the saved lse --------------------------------


def _dq_kernel(*refs, distances, num_rungs, pad, seq_len, scale, rung_lanes):
    lo_ref, frac_ref = refs[:2] if num_rungs else (None, None)
    refs = refs[2:] if num_rungs else refs
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs[:7]
    group, block, _ = q_ref.shape
    s0 = pl.program_id(2) * block
    rows = _rows(s0, block)
    q = [q_ref[g].astype(F32) * scale for g in range(group)]
    do = [do_ref[g].astype(F32) for g in range(group)]
    lse = [lse_ref[g] for g in range(group)]
    delta = [delta_ref[g] for g in range(group)]
    dq = [jnp.zeros(q[0].shape, F32)] * group
    dfrac = jnp.zeros((1, rung_lanes), F32)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, rung_lanes), 1)
    for slot, (shift, frac) in enumerate(_slots(distances, num_rungs, lo_ref, frac_ref)):
        k0, k_diff = _load(k_ref, pad + s0 - shift, block, rows, shift, frac)
        v0, v_diff = _load(v_ref, pad + s0 - shift, block, rows, shift, frac)
        k, v = _interp(k0, k_diff, frac), _interp(v0, v_diff, frac)
        valid = (rows >= shift) & (rows < seq_len)
        d_slot = 0.0
        for g in range(group):
            p = jnp.where(valid, jnp.exp(jnp.sum(q[g] * k, axis=-1) - lse[g]), 0.0)
            ds = p * (jnp.sum(do[g] * v, axis=-1) - delta[g])
            dq[g] = dq[g] + ds[:, None] * k
            if frac is not None:
                # frac moves the key (score q.(far - near)) and the value (do.(far - near))
                d_slot += jnp.sum(ds * jnp.sum(q[g] * k_diff, axis=-1)) + jnp.sum(p * jnp.sum(do[g] * v_diff, axis=-1))
        if frac is not None:
            dfrac = dfrac + jnp.where(lane == slot - len(distances), d_slot, 0.0)
    for g in range(group):
        dq_ref[g] = (dq[g] * scale).astype(dq_ref.dtype)
    if num_rungs:
        refs[7][...] = dfrac


# --- dk/dv: a block of keys, walking the same slots the other way ---------------------------


def _dkdv_kernel(*refs, distances, num_rungs, pad, seq_len, scale):
    lo_ref, frac_ref = refs[:2] if num_rungs else (None, None)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs[2:] if num_rungs else refs
    block = dk_ref.shape[0]
    group, t_rows = q_ref.shape[:2]
    j0 = pl.program_id(2) * block
    dk = jnp.zeros(dk_ref.shape, F32)
    dv = jnp.zeros(dv_ref.shape, F32)

    def fold(query_start, key_start, shift, frac, weight):
        """Queries i = j + (query_start - j0) against their slot key, whose near row is at key_start."""
        nonlocal dk, dv
        rows = _rows(query_start, block)
        k = _interp(*_load(k_ref, key_start, block, rows, shift, frac), frac)
        v = _interp(*_load(v_ref, key_start, block, rows, shift, frac), frac)
        start = jnp.minimum(query_start, t_rows - block)  # beyond it every row is >= seq_len
        valid = rows < seq_len  # padded rows hold lse = -inf: select, never multiply
        for g in range(group):
            q = q_ref[g, pl.ds(start, block), :].astype(F32) * scale
            do = do_ref[g, pl.ds(start, block), :].astype(F32)
            p = jnp.where(valid, jnp.exp(jnp.sum(q * k, axis=-1) - lse_ref[g, pl.ds(start, block)]), 0.0)
            p = p if weight is None else p * weight(rows)
            ds = p * (jnp.sum(do * v, axis=-1) - delta_ref[g, pl.ds(start, block)])
            dk = dk + ds[:, None] * q
            dv = dv + p[:, None] * do

    for shift, frac in _slots(distances, num_rungs, lo_ref, frac_ref):
        if frac is None:
            fold(j0 + shift, pad + j0, shift, None, None)
            continue
        # key j is the near key of query j + lo (weight 1-frac; 1 for j = 0, where the far
        # key clamps onto it) and the far key of query j + lo + 1 (weight frac)
        fold(j0 + shift, pad + j0, shift, frac, lambda rows, lo=shift, f=frac: jnp.where(rows == lo, 1.0, 1.0 - f))
        fold(j0 + shift + 1, pad + j0 + 1, shift, frac, lambda rows, f=frac: jnp.full(rows.shape, f))
    dk_ref[...] = dk.astype(dk_ref.dtype)  # q was scaled when loaded
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --- pallas_call builders -------------------------------------------------------------------
# Grid (B, K, row blocks). Row-blocked operands index their row axis by the third grid index;
# shifted operands are whole-sequence blocks for the program's (batch, KV head), sliced inside.


def _whole(*shape):
    return pl.BlockSpec((None, None, *shape), lambda b, h, i: (b, h) + (0,) * len(shape))


def _rows_of(*shape, axis=1):
    """Blocks of ``shape`` whose axis ``axis`` walks the rows with the third grid index."""
    return pl.BlockSpec((None, None, *shape), lambda b, h, i: (b, h) + tuple(i if a == axis else 0 for a in range(len(shape))))


def _call(kernel, rungs, operands, *, out_specs, out_shape, grid, block_sizes, backend, name):
    scalars = [be.scalar_spec(backend)] * 2 if rungs is not None else []
    in_specs = scalars + [spec for spec, _ in operands]
    args = (*(rungs or ()), *(x for _, x in operands))
    return be.call(kernel, backend=backend, block_sizes=block_sizes, grid=grid, in_specs=in_specs,
                   out_specs=out_specs, out_shape=out_shape, name=name)(*args)


def _static(rungs, distances, pad, seq_len, d):
    return dict(distances=distances, num_rungs=0 if rungs is None else rungs[0].shape[0], pad=pad, seq_len=seq_len, scale=d**-0.5)


def forward(q, k, v, rungs, *, distances, seq_len, pad, block_sizes, backend):
    """q [B,K,G,T+P,D], k/v [B,K,P+T+P,D], rungs None or (lo [R] int32, frac [R] f32)
    -> o [B,K,G,T,D] in q's dtype, lse [B,K,G,T] float32."""
    b, kh, g, t_rows, d = q.shape
    bq, t = block_sizes.block_q, t_rows - pad
    return _call(
        functools.partial(_forward_kernel, **_static(rungs, distances, pad, seq_len, d)), rungs,
        [(_rows_of(g, bq, d), q), (_whole(k.shape[2], d), k), (_whole(k.shape[2], d), v)],
        out_specs=[_rows_of(g, bq, d), _rows_of(g, bq)],
        out_shape=[jax.ShapeDtypeStruct((b, kh, g, t, d), q.dtype), jax.ShapeDtypeStruct((b, kh, g, t), F32)],
        grid=(b, kh, t // bq), block_sizes=block_sizes, backend=backend, name="offset_attention_fwd",
    )


def backward(q, k, v, do, lse, delta, rungs, *, distances, seq_len, pad, block_sizes, backend):
    """Cotangents for ``forward``'s inputs. do like q; lse, delta [B,K,G,T+P] float32 (delta =
    rowsum(do * o) - dlse). Returns dq [B,K,G,T,D], dk, dv [B,K,T,D], dfrac [R] float32 or None."""
    b, kh, g, t_rows, d = q.shape
    bq, bk, t = block_sizes.block_q, block_sizes.block_k, t_rows - pad
    static = _static(rungs, distances, pad, seq_len, d)
    lanes = 1 << max(static["num_rungs"] - 1, 0).bit_length()  # Triton stores power-of-two shapes
    whole_kv = _whole(k.shape[2], d)
    out_specs = [_rows_of(g, bq, d)]
    out_shape = [jax.ShapeDtypeStruct((b, kh, g, t, d), q.dtype)]
    if rungs is not None:  # one partial d frac per program, summed below
        out_specs.append(pl.BlockSpec((None, None, None, 1, lanes), lambda b, h, i: (b, h, i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, t // bq, 1, lanes), F32))
    dq_out = _call(
        functools.partial(_dq_kernel, rung_lanes=lanes, **static), rungs,
        [(_rows_of(g, bq, d), q), (whole_kv, k), (whole_kv, v), (_rows_of(g, bq, d), do), (_rows_of(g, bq), lse), (_rows_of(g, bq), delta)],
        out_specs=out_specs, out_shape=out_shape, grid=(b, kh, t // bq), block_sizes=block_sizes, backend=backend, name="offset_attention_dq",
    )
    dk, dv = _call(
        functools.partial(_dkdv_kernel, **static), rungs,
        [(_whole(g, t_rows, d), q), (whole_kv, k), (whole_kv, v), (_whole(g, t_rows, d), do), (_whole(g, t_rows), lse), (_whole(g, t_rows), delta)],
        out_specs=[_rows_of(bk, d, axis=0)] * 2, out_shape=[jax.ShapeDtypeStruct((b, kh, t, d), k.dtype)] * 2,
        grid=(b, kh, t // bk), block_sizes=block_sizes, backend=backend, name="offset_attention_dkdv",
    )
    dfrac = None if rungs is None else jnp.sum(dq_out[1], axis=(0, 1, 2, 3))[: static["num_rungs"]]
    return dq_out[0], dk, dv, dfrac
