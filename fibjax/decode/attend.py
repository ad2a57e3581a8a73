"""Attention of one layer while decoding: the prompt at once, then one query against the cache.

The prompt goes through the library's own paths (``fibjax.attention``) with the attended set
of the capacity L (``cache.py``), so its rows are those of a full forward at L. A new token's
query reads its attended rows straight from the cache: a gather of |S| rows for offset layers
(constant work), every row up to the query for dense layers (work grows with the position).
Scores and softmax follow the full paths: queries pre-scaled in the model dtype, scores and
probabilities in float32, a learned rung's score interpolated between its near and far keys.
Letters: B batch, H query heads, K KV heads, G = H/K, E head dim, S attended rows, R rung slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fibjax import attention as attn_lib
from fibjax.attention.common import group_queries, masked_softmax, stats_dtype
from fibjax.attention.offset_xla import learned_rungs
from fibjax.decode.cache import KV, LayerPlan

Array = jax.Array


def attend_prompt(plan: LayerPlan, attn, q_BPHE: Array, k_BPKE: Array, v_BPKE: Array) -> Array:
    """The prompt's attention output with the library's paths, at the capacity's attended set."""
    if plan.kind == "full":
        return attn_lib.dense_attention(q_BPHE, k_BPKE, v_BPKE)
    if plan.kind == "static":
        return attn_lib.offset_attention(q_BPHE, k_BPKE, v_BPKE, distances=plan.distances)
    # an explicit base (the rungs at L) keeps the rungs of pow2 those of the capacity
    return attn_lib.interpolated_attention(q_BPHE, k_BPKE, v_BPKE, window=plan.window, base=plan.rungs, alpha=attn.alpha())


def _scores(q_BKGE: Array, k_BSKE: Array) -> Array:
    return jnp.einsum("bkge,bske->bkgs", q_BKGE, k_BSKE, preferred_element_type=stats_dtype(q_BKGE))


def _values(p_BKGS: Array, v_BSKE: Array) -> Array:
    return jnp.einsum("bkgs,bske->bkge", p_BKGS, v_BSKE.astype(p_BKGS.dtype))


def _rows(x_BRKE: Array, positions_S: Array) -> Array:
    """The cached rows of absolute ``positions_S`` (ring index p mod R; callers mask p < 0)."""
    return jnp.take(x_BRKE, positions_S % x_BRKE.shape[1], axis=1)


def attend_token(plan: LayerPlan, attn, q_B1HE: Array, kv: KV, pos: Array) -> Array:
    """Output [B, 1, H, E] of the query at position ``pos`` (traced), its own key already cached."""
    b, _, h, e = q_B1HE.shape
    q_BKGE = group_queries(q_B1HE, kv.k.shape[2])[:, 0]
    if plan.kind == "full":
        s_BKGS = _scores(q_BKGE, kv.k)
        p_BKGS, _ = masked_softmax(s_BKGS, jnp.arange(kv.k.shape[1]) <= pos)
        o_BKGE = _values(p_BKGS, kv.v)
    else:
        d_S = np.asarray(plan.distances)
        scores, valid = [_scores(q_BKGE, _rows(kv.k, pos - d_S))], [pos >= d_S]
        if plan.kind == "learned" and plan.slots:
            lo_R, frac_R, active_R = learned_rungs(attn.alpha(), plan.slots, window=plan.window, seq_len=plan.max_len)
            near_R, far_R = pos - lo_R, jnp.maximum(pos - lo_R - 1, 0)  # far neighbour clamped at position 0
            s_near, s_far = _scores(q_BKGE, _rows(kv.k, near_R)), _scores(q_BKGE, _rows(kv.k, far_R))
            scores.append(s_near + frac_R * (s_far - s_near))  # the score is linear in the key
            valid.append((pos >= lo_R) & active_R)
        p_BKGS, _ = masked_softmax(jnp.concatenate(scores, -1), jnp.concatenate(valid, -1))
        n = len(d_S)
        o_BKGE = _values(p_BKGS[..., :n], _rows(kv.v, pos - d_S))
        if plan.kind == "learned" and plan.slots:
            p_BKGR = p_BKGS[..., n:]
            o_BKGE += _values(p_BKGR * (1 - frac_R), _rows(kv.v, near_R)) + _values(p_BKGR * frac_R, _rows(kv.v, far_R))
    return o_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)
