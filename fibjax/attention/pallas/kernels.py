"""The three Pallas kernels of offset attention: forward, dq (+ d frac), dk/dv.

Every attended distance is a contiguous shifted slice of K/V shared by all queries, so the
kernels never build a mask over [T, T]. A program owns a block of C rows. The window {0..W}
is one **band tile**: the C queries against the 2C keys that end with them, one tile product
(the tensor cores' shape on a GPU) per side, masked to 0 <= i - j <= W, so W + 1 distances
cost two tile products instead of W + 1 row-wise passes (``_band``: distances 0..min(W, C)).
Every other distance is a *slot*: the program reads the shifted block and works row-wise
(one key per query per slot: a multiply-reduce over D). A slot is either a static distance d
(a Python int: the static rungs) or a learned rung (lo, frac): runtime scalars, so alpha never
recompiles. A rung's key is (1-frac) K[i-lo] + frac K[max(i-lo-1, 0)], valid iff i >= lo,
both rows read from the same two adjacent shifted blocks; an inactive rung arrives with lo =
T, which no query reaches. The backward is two kernels (dq; dk/dv), each walking the band
tile and then the slots, writing only its own block: no atomics.

Kernel layout (built by ``ops.py``; T here is the padded length, P the pad, a block size):
q, do   [B, K, G, T+P, D]   queries grouped under their KV head; P zero rows at the end
k, v    [B, K, P+T+P, D]    P zero rows at both ends, so every shifted block is in bounds
lse, delta [B, K, G, T+P]   float32
Inside a kernel C is the rows of the program's block. Softmax statistics are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fibjax.attention.pallas import backend as be

F32 = jnp.float32


def _split_refs(refs, num_rungs):
    """(lo_ref, frac_ref), the other refs: the rung scalars come first when there are rungs."""
    return (refs[:2], refs[2:]) if num_rungs else ((None, None), refs)


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
    near_CD = ref[pl.ds(start, size), :].astype(F32)
    far_CD = ref[pl.ds(start - 1, size), :].astype(F32)
    return near_CD, jnp.where((rows == shift)[:, None], 0.0, far_CD - near_CD)


def _interp(x, diff, frac):
    return x if frac is None else x + frac * diff


def _rows(start, size):
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


# Triton's dot needs every side >= 16; below that the window stays row-wise slots
MIN_DOT = 16


def _band(distances, rows: int, backend: str):
    """(W', the other distances): the leading run 0..W' of ``distances`` (W' <= rows, the most a
    [rows, 2 rows] band tile holds) goes to the band tile; W' is None when there is none."""
    run = 0
    while run < len(distances) and distances[run] == run and run <= rows:
        run += 1
    if run == 0 or (backend == "triton" and rows < MIN_DOT):
        return None, tuple(distances)
    return run - 1, tuple(distances[run:])


def _dot(a, b, axes=(1, 0)):
    """A tile product with float32 accumulation, contracting axis ``axes[0]`` of a with ``axes[1]``
    of b (``lax.dot_general``: the lowering every backend has; ``pl.dot`` is Triton's alone now)."""
    return jax.lax.dot_general(a, b, (((axes[0],), (axes[1],)), ((), ())), preferred_element_type=F32)


def _band_mask(query_start, queries: int, key_start, keys: int, width: int, seq_len: int):
    """[queries, keys]: 0 <= i - j <= width, j >= 0 and i < seq_len (the band tile's keys)."""
    i = query_start + jax.lax.broadcasted_iota(jnp.int32, (queries, keys), 0)
    j = key_start + jax.lax.broadcasted_iota(jnp.int32, (queries, keys), 1)
    return (i - j >= 0) & (i - j <= width) & (j >= 0) & (i < seq_len)


# --- forward: a block of queries, an online softmax over the slots -------------------------


def _forward_kernel(*refs, distances, num_rungs, pad, seq_len, scale, band):
    (lo_ref, frac_ref), (q_ref, k_ref, v_ref, o_ref, lse_ref) = _split_refs(refs, num_rungs)
    group, block, _ = q_ref.shape
    s0 = pl.program_id(2) * block
    rows = _rows(s0, block)
    q_CD = [q_ref[g].astype(F32) * scale for g in range(group)]
    max_C = [jnp.full((block,), -jnp.inf, F32)] * group
    sum_C = [jnp.zeros((block,), F32)] * group
    acc_CD = [jnp.zeros(q_CD[0].shape, F32)] * group
    if band is not None:  # the window: keys s0 - C .. s0 + C - 1, in bounds thanks to the pad
        k_LD, v_LD = k_ref[pl.ds(pad + s0 - block, 2 * block), :], v_ref[pl.ds(pad + s0 - block, 2 * block), :]
        band_CL = _band_mask(s0, block, s0 - block, 2 * block, band, seq_len)
        for g in range(group):
            s_CL = jnp.where(band_CL, _dot(q_ref[g], k_LD, (1, 1)) * scale, -jnp.inf)
            max_C[g] = jnp.max(s_CL, axis=1)
            p_CL = jnp.exp(s_CL - jnp.where(max_C[g] == -jnp.inf, 0.0, max_C[g])[:, None])
            sum_C[g] = jnp.sum(p_CL, axis=1)
            acc_CD[g] = _dot(p_CL.astype(v_LD.dtype), v_LD)
    for shift, frac in _slots(distances, num_rungs, lo_ref, frac_ref):
        k_CD = _interp(*_load(k_ref, pad + s0 - shift, block, rows, shift, frac), frac)
        v_CD = _interp(*_load(v_ref, pad + s0 - shift, block, rows, shift, frac), frac)
        valid_C = (rows >= shift) & (rows < seq_len)
        for g in range(group):
            s_C = jnp.where(valid_C, jnp.sum(q_CD[g] * k_CD, axis=-1), -jnp.inf)
            new_max_C = jnp.maximum(max_C[g], s_C)
            safe_max_C = jnp.where(new_max_C == -jnp.inf, 0.0, new_max_C)  # no key yet: avoid inf - inf
            corr_C, p_C = jnp.exp(max_C[g] - safe_max_C), jnp.exp(s_C - safe_max_C)
            sum_C[g] = sum_C[g] * corr_C + p_C
            acc_CD[g] = acc_CD[g] * corr_C[:, None] + p_C[:, None] * v_CD
            max_C[g] = new_max_C
    for g in range(group):
        nonempty_C = sum_C[g] > 0  # a row with no valid key: zeros out, lse = -inf
        safe_sum_C = jnp.where(nonempty_C, sum_C[g], 1.0)
        o_ref[g] = (acc_CD[g] / safe_sum_C[:, None]).astype(o_ref.dtype)
        lse_ref[g] = jnp.where(nonempty_C, max_C[g] + jnp.log(safe_sum_C), -jnp.inf)


# --- dq: the same walk, with p recomputed from the saved lse --------------------------------


def _dq_kernel(*refs, distances, num_rungs, pad, seq_len, scale, rung_lanes, band):
    (lo_ref, frac_ref), (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *dfrac_ref) = _split_refs(refs, num_rungs)
    group, block, _ = q_ref.shape
    s0 = pl.program_id(2) * block
    rows = _rows(s0, block)
    q_CD = [q_ref[g].astype(F32) * scale for g in range(group)]
    do_CD = [do_ref[g].astype(F32) for g in range(group)]
    lse_C, delta_C = [lse_ref[g] for g in range(group)], [delta_ref[g] for g in range(group)]
    dq_CD = [jnp.zeros(q_CD[0].shape, F32)] * group
    if band is not None:  # the forward's band tile; ds = p (do.v - delta), dq = ds k
        k_LD, v_LD = k_ref[pl.ds(pad + s0 - block, 2 * block), :], v_ref[pl.ds(pad + s0 - block, 2 * block), :]
        band_CL = _band_mask(s0, block, s0 - block, 2 * block, band, seq_len)
        for g in range(group):
            p_CL = jnp.where(band_CL, jnp.exp(_dot(q_ref[g], k_LD, (1, 1)) * scale - lse_C[g][:, None]), 0.0)
            ds_CL = p_CL * (_dot(do_ref[g], v_LD, (1, 1)) - delta_C[g][:, None])
            dq_CD[g] = _dot(ds_CL.astype(k_LD.dtype), k_LD)
    dfrac_1R = jnp.zeros((1, rung_lanes), F32)  # R padded to a power of two (Triton stores)
    lane_1R = jax.lax.broadcasted_iota(jnp.int32, (1, rung_lanes), 1)
    for slot, (shift, frac) in enumerate(_slots(distances, num_rungs, lo_ref, frac_ref)):
        k_CD, dk_far_CD = _load(k_ref, pad + s0 - shift, block, rows, shift, frac)
        v_CD, dv_far_CD = _load(v_ref, pad + s0 - shift, block, rows, shift, frac)
        k_CD, v_CD = _interp(k_CD, dk_far_CD, frac), _interp(v_CD, dv_far_CD, frac)
        valid_C = (rows >= shift) & (rows < seq_len)
        dfrac = 0.0
        for g in range(group):
            p_C = jnp.where(valid_C, jnp.exp(jnp.sum(q_CD[g] * k_CD, axis=-1) - lse_C[g]), 0.0)
            ds_C = p_C * (jnp.sum(do_CD[g] * v_CD, axis=-1) - delta_C[g])
            dq_CD[g] = dq_CD[g] + ds_C[:, None] * k_CD
            if frac is not None:  # frac moves the key (score q.(far - near)) and the value (do.(far - near))
                dfrac += jnp.sum(ds_C * jnp.sum(q_CD[g] * dk_far_CD, axis=-1)) + jnp.sum(p_C * jnp.sum(do_CD[g] * dv_far_CD, axis=-1))
        if frac is not None:
            dfrac_1R = dfrac_1R + jnp.where(lane_1R == slot - len(distances), dfrac, 0.0)
    for g in range(group):
        dq_ref[g] = (dq_CD[g] * scale).astype(dq_ref.dtype)
    if num_rungs:
        dfrac_ref[0][...] = dfrac_1R


# --- dk/dv: a block of keys, walking the same slots the other way ---------------------------


def _dkdv_kernel(*refs, distances, num_rungs, pad, seq_len, scale, band):
    (lo_ref, frac_ref), (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = _split_refs(refs, num_rungs)
    block = dk_ref.shape[0]
    group, t_rows = q_ref.shape[:2]
    j0 = pl.program_id(2) * block
    dk_CD = jnp.zeros(dk_ref.shape, F32)
    dv_CD = jnp.zeros(dv_ref.shape, F32)
    if band is not None:  # keys j0 .. j0 + C - 1 against the 2C queries that can see them by the window
        k_CD, v_CD = k_ref[pl.ds(pad + j0, block), :], v_ref[pl.ds(pad + j0, block), :]
        band_LC = _band_mask(j0, 2 * block, j0, block, band, seq_len)
        for g in range(group):
            q_LD, do_LD = q_ref[g, pl.ds(j0, 2 * block), :], do_ref[g, pl.ds(j0, 2 * block), :]
            lse_L, delta_L = lse_ref[g, pl.ds(j0, 2 * block)], delta_ref[g, pl.ds(j0, 2 * block)]
            # rows past the sequence hold lse = -inf: select, never multiply
            p_LC = jnp.where(band_LC, jnp.exp(_dot(q_LD, k_CD, (1, 1)) * scale - lse_L[:, None]), 0.0)
            ds_LC = p_LC * (_dot(do_LD, v_CD, (1, 1)) - delta_L[:, None])
            dv_CD = dv_CD + _dot(p_LC.astype(do_LD.dtype), do_LD, (0, 0))
            dk_CD = dk_CD + _dot(ds_LC.astype(q_LD.dtype), q_LD, (0, 0)) * scale

    def fold(query_start, key_start, shift, frac, weight):
        """Queries i = j + (query_start - j0) against their slot key, whose near row is at key_start."""
        nonlocal dk_CD, dv_CD
        rows = _rows(query_start, block)
        k_CD = _interp(*_load(k_ref, key_start, block, rows, shift, frac), frac)
        v_CD = _interp(*_load(v_ref, key_start, block, rows, shift, frac), frac)
        start = jnp.minimum(query_start, t_rows - block)  # beyond it every row is >= seq_len
        valid_C = rows < seq_len  # padded rows hold lse = -inf: select, never multiply
        for g in range(group):
            q_CD = q_ref[g, pl.ds(start, block), :].astype(F32) * scale
            do_CD = do_ref[g, pl.ds(start, block), :].astype(F32)
            p_C = jnp.where(valid_C, jnp.exp(jnp.sum(q_CD * k_CD, axis=-1) - lse_ref[g, pl.ds(start, block)]), 0.0)
            p_C = p_C if weight is None else p_C * weight(rows)  # d key_i / d K[j], which also scales d out / d V[j]
            ds_C = p_C * (jnp.sum(do_CD * v_CD, axis=-1) - delta_ref[g, pl.ds(start, block)])
            dk_CD = dk_CD + ds_C[:, None] * q_CD
            dv_CD = dv_CD + p_C[:, None] * do_CD

    for shift, frac in _slots(distances, num_rungs, lo_ref, frac_ref):
        if frac is None:
            fold(j0 + shift, pad + j0, shift, None, None)
            continue
        # key j is the near key of query j + lo (weight 1-frac; 1 for j = 0, where the far
        # key clamps onto it) and the far key of query j + lo + 1 (weight frac)
        fold(j0 + shift, pad + j0, shift, frac, lambda rows, lo=shift, f=frac: jnp.where(rows == lo, 1.0, 1.0 - f))
        fold(j0 + shift + 1, pad + j0 + 1, shift, frac, lambda rows, f=frac: jnp.full(rows.shape, f))
    dk_ref[...] = dk_CD.astype(dk_ref.dtype)  # the slots' q was scaled when loaded, the band's after its dot
    dv_ref[...] = dv_CD.astype(dv_ref.dtype)


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
    return be.call(kernel, backend=backend, block_sizes=block_sizes, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, name=name)(*args)


def _kernel_params(rungs, distances, pad, seq_len, d, rows, backend):
    """The kernels' static arguments for programs of ``rows`` rows: the band tile and the slots."""
    band, slots = _band(distances, rows, backend)
    return dict(distances=slots, band=band, num_rungs=0 if rungs is None else rungs[0].shape[0], pad=pad, seq_len=seq_len, scale=d**-0.5)


def forward(q, k, v, rungs, *, distances, seq_len, pad, block_sizes, backend):
    """q [B,K,G,T+P,D], k/v [B,K,P+T+P,D], rungs None or (lo [R] int32, frac [R] f32)
    -> o [B,K,G,T,D] in q's dtype, lse [B,K,G,T] float32."""
    b, kh, g, t_rows, d = q.shape
    bq, t = block_sizes.block_q, t_rows - pad
    return _call(
        functools.partial(_forward_kernel, **_kernel_params(rungs, distances, pad, seq_len, d, bq, backend)),
        rungs,
        [(_rows_of(g, bq, d), q), (_whole(k.shape[2], d), k), (_whole(k.shape[2], d), v)],
        out_specs=[_rows_of(g, bq, d), _rows_of(g, bq)],
        out_shape=[jax.ShapeDtypeStruct((b, kh, g, t, d), q.dtype), jax.ShapeDtypeStruct((b, kh, g, t), F32)],
        grid=(b, kh, t // bq),
        block_sizes=block_sizes,
        backend=backend,
        name="offset_attention_fwd",
    )


def backward(q, k, v, do, lse, delta, rungs, *, distances, seq_len, pad, block_sizes, backend):
    """Cotangents for ``forward``'s inputs. do like q; lse, delta [B,K,G,T+P] float32 (delta =
    rowsum(do * o) - dlse). Returns dq [B,K,G,T,D], dk, dv [B,K,T,D], dfrac [R] float32 or None."""
    b, kh, g, t_rows, d = q.shape
    bq, bk, t = block_sizes.block_q, block_sizes.block_k, t_rows - pad
    params = _kernel_params(rungs, distances, pad, seq_len, d, bq, backend)
    lanes = 1 << max(params["num_rungs"] - 1, 0).bit_length()  # Triton stores power-of-two shapes
    whole_kv = _whole(k.shape[2], d)
    out_specs = [_rows_of(g, bq, d)]
    out_shape = [jax.ShapeDtypeStruct((b, kh, g, t, d), q.dtype)]
    if rungs is not None:  # one partial d frac per program, summed below
        out_specs.append(pl.BlockSpec((None, None, None, 1, lanes), lambda b, h, i: (b, h, i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, t // bq, 1, lanes), F32))
    dq_out = _call(
        functools.partial(_dq_kernel, rung_lanes=lanes, **params),
        rungs,
        [(_rows_of(g, bq, d), q), (whole_kv, k), (whole_kv, v), (_rows_of(g, bq, d), do), (_rows_of(g, bq), lse), (_rows_of(g, bq), delta)],
        out_specs=out_specs,
        out_shape=out_shape,
        grid=(b, kh, t // bq),
        block_sizes=block_sizes,
        backend=backend,
        name="offset_attention_dq",
    )
    dk, dv = _call(
        functools.partial(_dkdv_kernel, **_kernel_params(rungs, distances, pad, seq_len, d, bk, backend)),
        rungs,
        [(_whole(g, t_rows, d), q), (whole_kv, k), (whole_kv, v), (_whole(g, t_rows, d), do), (_whole(g, t_rows), lse), (_whole(g, t_rows), delta)],
        out_specs=[_rows_of(bk, d, axis=0)] * 2,
        out_shape=[jax.ShapeDtypeStruct((b, kh, t, d), k.dtype)] * 2,
        grid=(b, kh, t // bk),
        block_sizes=block_sizes,
        backend=backend,
        name="offset_attention_dkdv",
    )
    dfrac = None if rungs is None else jnp.sum(dq_out[1], axis=(0, 1, 2, 3))[: params["num_rungs"]]
    return dq_out[0], dk, dv, dfrac
