"""The block-sparse reference: selection by plain loops in float64, then a dense [T, T] mask.

Slow and obviously correct, to be read against the issue's definition: query i in block
c = i // B keeps its own block and the S-1 earlier blocks b < c with the largest
sum_g q_{i,g} . mean(K_b) (ties: lower b), and attends every selected key j <= i.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tests import oracle

# Forward / gradient tolerances (atol, rtol) against the float32 oracle: as the other paths'.
TOL = oracle.TOL
GRAD_TOL = oracle.GRAD_TOL

# one compiled program per shape instead of op-by-op dispatch (a third of the time)
_masked_attention = jax.jit(oracle.masked_attention)


def selection_scores(q, k, block_size):
    """scores[b, i, kv, n] = sum_g q[b, i, kv*G + g] . mean(K[b, n*B:(n+1)*B, kv]) in float64
    (NaN where block n is not strictly before query i's block)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    bsz, t, h, _ = q.shape
    kh = k.shape[2]
    g = h // kh
    n_blocks = -(-t // block_size)
    out = np.full((bsz, t, kh, n_blocks), np.nan)
    for b in range(bsz):
        for i in range(t):
            for kv in range(kh):
                qsum = q[b, i, kv * g : (kv + 1) * g].sum(axis=0)
                for n in range(i // block_size):
                    # q . mean(K_n), dividing last so that exactly equal dot products stay equal
                    out[b, i, kv, n] = qsum @ k[b, n * block_size : (n + 1) * block_size, kv].sum(axis=0) / block_size
    return out


def selected_blocks(q, k, block_size, num_blocks):
    """bool [B, T, K, N]: the blocks each (batch, query, KV head) attends."""
    scores = selection_scores(q, k, block_size)
    bsz, t, kh, n_blocks = scores.shape
    chosen = np.zeros(scores.shape, bool)
    for b in range(bsz):
        for i in range(t):
            own = i // block_size
            for kv in range(kh):
                chosen[b, i, kv, own] = True
                # descending score, then ascending block index: a stable sort on -score
                order = sorted(range(own), key=lambda n: (-scores[b, i, kv, n], n))
                for n in order[: num_blocks - 1]:
                    chosen[b, i, kv, n] = True
    return chosen


def indices_to_blocks(idx, n_blocks):
    """The implementation's slots int [B, T, K, S] (-1 = empty) -> bool [B, T, K, N]."""
    idx = np.asarray(idx)
    out = np.zeros((*idx.shape[:3], n_blocks + 1), bool)
    np.put_along_axis(out, np.where(idx < 0, n_blocks, idx), True, axis=-1)
    return out[..., :n_blocks]


def key_mask(chosen_BTKN, t, block_size):
    """bool [B, K, T, T]: allowed[b, kv, i, j] iff j's block is chosen for i and j <= i."""
    block_of_key = np.arange(t) // block_size
    allowed = chosen_BTKN[:, :, :, block_of_key]  # [B, T(i), K, T(j)]
    allowed = allowed & (np.arange(t)[None, :, None, None] >= np.arange(t)[None, None, None, :])
    return np.transpose(allowed, (0, 2, 1, 3))


def block_sparse_reference(q, k, v, block_size, num_blocks, chosen=None):
    """(out [B,T,H,D] float32, lse [B,T,H]) of block-sparse attention via the dense mask."""
    t, h, kh = q.shape[1], q.shape[2], k.shape[2]
    if chosen is None:
        chosen = selected_blocks(q, k, block_size, num_blocks)
    mask_BKTT = key_mask(chosen, t, block_size)
    mask_BHTT = np.repeat(mask_BKTT, h // kh, axis=1)  # query head kv*G + g uses KV head kv
    return _masked_attention(q, k, v, jnp.asarray(mask_BHTT))


def dyadic_qkv(key, b, t, h, kh, d, dtype=jnp.float32, scale=8):
    """Random q, k, v on the grid 1/scale in [-3, 3]: exact in bfloat16, and every selection
    score is an exact float32 sum, so the float64 loops and the kernel agree on every tie."""
    return tuple(jnp.clip(jnp.round(x * scale) / scale, -3, 3).astype(dtype) for x in oracle.random_qkv(key, b, t, h, kh, d))


def direct_dropped_mass(q, k, chosen, block_size):
    """Mean over (batch, query, head) of the full-softmax probability on unselected keys, by
    summing probabilities (not via the log-sum-exps)."""
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    bsz, t, h, d = q64.shape
    kh = k64.shape[2]
    mask = key_mask(chosen, t, block_size)
    causal = np.tril(np.ones((t, t), bool))
    total = []
    for b in range(bsz):
        for head in range(h):
            kv = head // (h // kh)
            s = q64[b, :, head] @ k64[b, :, kv].T / np.sqrt(d)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            total.append(np.where(mask[b, kv], 0.0, p).sum(axis=1))
    return float(np.mean(total))
