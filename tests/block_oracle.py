"""The block-sparse and NSA references: selection by plain loops in float64, then dense masks.

Slow and obviously correct, to be read against the definitions: query i in block c = i // B
keeps its own block and the S-1 earlier blocks b < c with the largest score (ties: lower b), and
attends every selected key j <= i. The score of block b, with key_b = mean(K_b) unless given:
  mean_key: sum_g q_{i,g} . key_b
  nsa_prob: sum_g softmax_n(q_{i,g} . key_n / sqrt(D))[b], n over the blocks with (n+1)B - 1 <= i.
NSA (``nsa_reference``): gates g_cmp, g_slc, g_win times the attention over the compressed blocks
with (n+1)B - 1 <= i, the selected blocks (nsa_prob on the compressed keys), and keys i-W .. i.
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


def selection_scores(q, k, block_size, rule="mean_key", rank_keys=None):
    """scores[b, i, kv, n] of block n for query i's KV group in float64 (NaN where block n is not
    strictly before query i's block); ``rank_keys`` [B, N, K, D] replace the block means."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    bsz, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    n_blocks = -(-t // block_size)
    out = np.full((bsz, t, kh, n_blocks), np.nan)
    for b in range(bsz):
        for i in range(t):
            for kv in range(kh):
                heads = q[b, i, kv * g : (kv + 1) * g]
                if rule == "mean_key" and rank_keys is None:
                    for n in range(i // block_size):
                        # q . mean(K_n), dividing last so that exactly equal dot products stay equal
                        out[b, i, kv, n] = heads.sum(axis=0) @ k[b, n * block_size : (n + 1) * block_size, kv].sum(axis=0) / block_size
                    continue
                past = range((i + 1) // block_size)  # blocks wholly at or before i
                keys = [_block_key(k, rank_keys, b, n, kv, block_size) for n in past]
                scores = np.zeros(len(keys))
                if rule == "mean_key":
                    scores = [heads.sum(axis=0) @ key for key in keys]
                elif keys:  # each head's softmax over the past blocks, summed over the group
                    for head in heads:
                        logits = np.array([head @ key for key in keys]) / np.sqrt(d)
                        scores += np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
                for n in range(i // block_size):
                    out[b, i, kv, n] = scores[n]
    return out


def _block_key(k, rank_keys, b, n, kv, block_size):
    if rank_keys is not None:
        return np.asarray(rank_keys, np.float64)[b, n, kv]
    return k[b, n * block_size : (n + 1) * block_size, kv].mean(axis=0)


def selected_blocks(q, k, block_size, num_blocks, rule="mean_key", rank_keys=None, scores=None):
    """bool [B, T, K, N]: the blocks each (batch, query, KV head) attends (``scores``: reuse them)."""
    scores = selection_scores(q, k, block_size, rule, rank_keys) if scores is None else scores
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


def selection_margin(scores, block_size, num_blocks):
    """Smallest gap, over queries, between the last chosen and the best unchosen earlier block's
    ``selection_scores`` (inf if none): a test on inexact scores needs it above float32 rounding."""
    gap = np.inf
    for b, i, kv in np.ndindex(*scores.shape[:3]):
        s = np.sort(scores[b, i, kv, : i // block_size])[::-1]
        if 1 < num_blocks <= len(s):  # some earlier block chosen and some left out
            gap = min(gap, s[num_blocks - 2] - s[num_blocks - 1])
    return gap


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


def _safe_masked_attention(q, k, v, allowed_TN):
    """masked attention whose rows with no allowed key give 0 (and finite gradients)."""
    nonempty_T = allowed_TN.any(axis=1)
    out, _ = _masked_attention(q, k, v, jnp.asarray(allowed_TN | ~nonempty_T[:, None]))
    return out * jnp.asarray(nonempty_T, out.dtype)[None, :, None, None]


def compressed_reference(q, k_cmp, v_cmp, block_size):
    """NSA's compressed branch [B,T,H,D]: keys/values k_cmp[n] for the blocks with (n+1)B - 1 <= i."""
    t, n_blocks = q.shape[1], k_cmp.shape[1]
    past_TN = np.array([[(n + 1) * block_size - 1 <= i for n in range(n_blocks)] for i in range(t)], bool).reshape(t, n_blocks)
    if n_blocks == 0:
        return jnp.zeros(q.shape, jnp.float32)
    return _safe_masked_attention(q, k_cmp, v_cmp, past_TN)


def nsa_reference(q, k, v, k_cmp, v_cmp, gates, block_size, num_blocks, window, chosen=None):
    """(out [B,T,H,D] float32, lse of the selected branch [B,T,H]) of NSA via dense masks."""
    if chosen is None:
        chosen = selected_blocks(q, k, block_size, num_blocks, "nsa_prob", k_cmp)
    o_cmp = compressed_reference(q, k_cmp, v_cmp, block_size)
    o_slc, lse = block_sparse_reference(q, k, v, block_size, num_blocks, chosen)
    o_win, _ = _masked_attention(q, k, v, jnp.asarray(oracle.distance_mask(q.shape[1], range(window + 1))))
    g = jnp.asarray(gates, o_slc.dtype)
    return g[..., 0, None] * o_cmp + g[..., 1, None] * o_slc + g[..., 2, None] * o_win, lse


def compress_reference(x, pos, w_in, w_out):
    """NSA's phi by loops in float64: per block n and KV head, mean(X) + relu(vec(X + P) W_in) W_out."""
    x, pos, w_in, w_out = (np.asarray(a, np.float64) for a in (x, pos, w_in, w_out))
    bsz, t, kh, d = x.shape
    j = pos.shape[0]
    out = np.zeros((bsz, t // j, kh, d))
    for b, n, kv in np.ndindex(*out.shape[:3]):
        block = x[b, n * j : (n + 1) * j, kv]
        out[b, n, kv] = block.mean(axis=0) + np.maximum((block + pos).reshape(-1) @ w_in, 0) @ w_out
    return out


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
