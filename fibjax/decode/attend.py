"""Attention of one layer while decoding: the prompt at once, then one query against the cache.

The prompt goes through the library's own paths (``fibjax.attention``) with the attended set
of the capacity L (``cache.py``), so its rows are those of a full forward at L. A new token's
query reads its attended rows straight from the cache: a gather of |S| rows for offset layers
(constant work), every row up to the query for dense layers (work grows with the position).
Scores and softmax follow the full paths: queries pre-scaled in the model dtype, scores and
probabilities in float32, a learned rung's score interpolated between its near and far keys.
NSA layers mix three such reads with the layer's gates: the compressed blocks (each compressed
once, in the step that completes it), the selected blocks' rows, and the window.
Letters: B batch, H query heads, K KV heads, G = H/K, E head dim, S attended rows, R rung slots,
M cache rows, N blocks, J keys per block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fibjax import attention as attn_lib
from fibjax.attention.common import group_queries, masked_softmax, stats_dtype
from fibjax.attention.offset_xla import traced_rung_taps
from fibjax.decode import cache as cache_lib
from fibjax.decode.cache import KV, LayerPlan

Array = jax.Array


def attend_prompt(plan: LayerPlan, attn, q_BPHE: Array, k_BPKE: Array, v_BPKE: Array, x_BPD: Array | None = None) -> Array:
    """The prompt's attention output with the library's paths, at the capacity's attended set
    (``x_BPD``, the layer's normed input, makes an NSA layer's gates and compressed blocks)."""
    acfg = attn.cfg.attention
    impl = acfg.implementation
    if plan.kind == "dense":
        return attn_lib.dense_attention(q_BPHE, k_BPKE, v_BPKE)
    if plan.kind == "block_sparse":  # a query's choice depends only on earlier blocks: the prompt alone decides it
        return attn_lib.block_sparse_attention(q_BPHE, k_BPKE, v_BPKE, block_size=acfg.block_size, num_blocks=plan.top + 1, block_rank=plan.rank)
    if plan.kind == "nsa":
        k_cmp, v_cmp, gates = attn.nsa(x_BPD, k_BPKE, v_BPKE)
        return attn_lib.nsa_attention(q_BPHE, k_BPKE, v_BPKE, k_cmp, v_cmp, gates, block_size=plan.block_size, num_blocks=plan.top + 1, window=plan.window)
    if plan.kind == "offset":
        return attn_lib.offset_attention(q_BPHE, k_BPKE, v_BPKE, distances=plan.distances, implementation=impl)
    # an explicit base (the rungs at L) keeps the rungs of pow2 those of the capacity
    return attn_lib.interpolated_attention(q_BPHE, k_BPKE, v_BPKE, window=plan.window, base=plan.base_rungs, alpha=attn.alpha(), implementation=impl)


def _scores(q_BKGE: Array, k_BKSE: Array) -> Array:
    return jnp.einsum("bkge,bkse->bkgs", q_BKGE, k_BKSE, preferred_element_type=stats_dtype(q_BKGE))


def _values(p_BKGS: Array, v_BKSE: Array) -> Array:
    return jnp.einsum("bkgs,bkse->bkge", p_BKGS, v_BKSE.astype(p_BKGS.dtype))


def _rows(x_BKME: Array, positions_S: Array) -> Array:
    """The cached rows of absolute ``positions_S`` (ring index p mod M; callers mask p < 0)."""
    return jnp.take(x_BKME, positions_S % x_BKME.shape[2], axis=2)


def _selected_rows(plan: LayerPlan, q_B1HE: Array, rank_BKNE: Array, pos: Array) -> Array:
    """Rows [B, K, S * block] of the blocks the query at ``pos`` attends (-1: an empty slot), chosen
    as ``block_sparse_attention`` chooses: its own block, then the ``plan.top`` earlier blocks
    that score highest, ties to the lower block. ``mean_key``: (sum over the group's heads of q)
    . (key sum); ``nsa_prob``: the sum over the group's heads of each head's softmax probability
    of the block among those wholly in the past, logits q . rank key / sqrt(E) (``rank_BKNE``:
    the block means, or NSA's compressed keys, with the block ``pos`` completes included)."""
    b, _, h, e = q_B1HE.shape
    kh, n = rank_BKNE.shape[1], rank_BKNE.shape[2]
    own = pos // plan.block_size
    blocks_BKS = jnp.full((b, kh, 1), own, jnp.int32)
    if plan.top:
        hi = jax.lax.Precision.HIGHEST
        q_BKGE = q_B1HE[:, 0].astype(jnp.float32).reshape(b, kh, h // kh, e)
        if plan.rank == "mean_key":
            s_BKN = jnp.einsum("bke,bkne->bkn", jnp.sum(q_BKGE, axis=2), rank_BKNE, precision=hi)
        else:
            s_BKGN = jnp.einsum("bkge,bkne->bkgn", q_BKGE, rank_BKNE.astype(jnp.float32), precision=hi) / math.sqrt(e)
            p_BKGN, _ = masked_softmax(s_BKGN, jnp.arange(n) < (pos + 1) // plan.block_size)
            s_BKN = jnp.sum(p_BKGN, axis=2)
        _, idx_BKT = jax.lax.top_k(jnp.where(jnp.arange(n) < own, s_BKN, -jnp.inf), plan.top)
        blocks_BKS = jnp.concatenate([blocks_BKS, jnp.where(idx_BKT < own, idx_BKT, -1).astype(jnp.int32)], axis=-1)
    rows_BKSJ = blocks_BKS[..., None] * plan.block_size + jnp.arange(plan.block_size)
    return jnp.where(blocks_BKS[..., None] >= 0, rows_BKSJ, -1).reshape(b, kh, -1)


def _take_rows(x_BKME: Array, rows_BKS: Array) -> Array:
    """x's rows per (batch, KV head): [B, K, S, E] (rows outside the cache read row 0; callers mask them)."""
    idx = jnp.clip(rows_BKS, 0, x_BKME.shape[2] - 1)
    return jnp.take_along_axis(x_BKME, idx[..., None], axis=2)


def _block_with_own_row(x_BKME: Array, own_BK1E: Array, pos: Array, block: int) -> Array:
    """The rows [B, K, J, E] of the block holding ``pos``, its row ``pos`` taken from ``own`` (the
    cache holds rows before ``pos`` only)."""
    start = pos // block * block
    rows_BKJE = jax.lax.dynamic_slice_in_dim(x_BKME, start, block, axis=2)
    return jnp.where(((start + jnp.arange(block)) == pos)[None, None, :, None], own_BK1E.astype(x_BKME.dtype), rows_BKJE)


def _read(q_BKGE: Array, keys: list[Array], values: list[Array], valid: list) -> Array:
    """One softmax over the concatenated keys ([B, K, S_i, E] each; ``valid`` [S_i] or [B, K, 1, S_i])
    and the matching read of the values: [B, K, G, E] float32 (0 where nothing is valid)."""
    b, kh = q_BKGE.shape[:2]
    valid = [jnp.broadcast_to(m, (b, kh, 1, m.shape[-1])) for m in valid]
    p_BKGS, _ = masked_softmax(jnp.concatenate([_scores(q_BKGE, k) for k in keys], -1), jnp.concatenate(valid, -1))
    o_BKGE, col = 0.0, 0
    for v in values:
        o_BKGE += _values(p_BKGS[..., col : col + v.shape[2]], v)
        col += v.shape[2]
    return o_BKGE


def attend_nsa_token(plan: LayerPlan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv: KV, pos) -> tuple[Array, tuple[Array, Array]]:
    """An NSA layer's output [B, 1, H, E] at ``pos`` (the three branches of ``nsa_attention``,
    mixed by the layer's gates) and its compressed blocks with the block ``pos`` completes."""
    b, _, h, e = q_B1HE.shape
    block = plan.block_size
    q_BKGE = group_queries(q_B1HE, kv.k.shape[1])[:, 0]
    own_k, own_v = jnp.swapaxes(k_B1KE, 1, 2), jnp.swapaxes(v_B1KE, 1, 2)
    kcmp, vcmp = (
        cache_lib.with_completed_block(cached, jnp.swapaxes(compress(jnp.swapaxes(_block_with_own_row(rows, own, pos, block), 1, 2)), 1, 2), pos, block)
        for cached, rows, own, compress in ((kv.kcmp, kv.k, own_k, attn.nsa.k_compress), (kv.vcmp, kv.v, own_v, attn.nsa.v_compress))
    )
    n = kcmp.shape[2]
    o_cmp = _read(q_BKGE, [kcmp], [vcmp], [jnp.arange(n) < (pos + 1) // block])
    rows_BKS = _selected_rows(plan, q_B1HE, kcmp, pos)
    sel_valid = ((rows_BKS >= 0) & (rows_BKS < pos))[:, :, None, :]
    o_slc = _read(q_BKGE, [own_k, _take_rows(kv.k, rows_BKS)], [own_v, _take_rows(kv.v, rows_BKS)], [np.ones(1, bool), sel_valid])
    d_W = np.arange(1, plan.window + 1)
    o_win = _read(q_BKGE, [own_k, _rows(kv.k, pos - d_W)], [own_v, _rows(kv.v, pos - d_W)], [np.ones(1, bool), pos >= d_W])
    gates_BH3 = jax.nn.sigmoid(attn.nsa.gate(x_B1D).astype(jnp.float32)).reshape(b, h, 3)
    out_BHE = sum(gates_BH3[..., i, None] * o.reshape(b, h, e).astype(q_B1HE.dtype).astype(jnp.float32) for i, o in enumerate((o_cmp, o_slc, o_win)))
    return out_BHE.reshape(b, 1, h, e).astype(q_B1HE.dtype), (kcmp, vcmp)


def attend_token(plan: LayerPlan, attn, q_B1HE: Array, k_B1KE: Array, v_B1KE: Array, kv: KV, pos: Array) -> Array:
    """Output [B, 1, H, E] of the query at position ``pos`` (traced) with its own key/value
    ``k_B1KE, v_B1KE`` and the cache ``kv`` as it was *before* this position was written.

    Reading the cache before the write (the query's own distance 0 comes from its key) lets XLA
    update the cache in place: reading the written cache made it copy every layer's cache.
    Every other attended row is older than ``pos``: distances 1..M-1 never reach row pos % M.
    """
    b, _, h, e = q_B1HE.shape
    q_BKGE = group_queries(q_B1HE, kv.k.shape[1])[:, 0]
    k_BK1E, v_BK1E = jnp.swapaxes(k_B1KE, 1, 2), jnp.swapaxes(v_B1KE, 1, 2)
    if plan.kind == "dense":  # row j holds position j
        keys, values, valid = [kv.k], [kv.v], [jnp.arange(kv.k.shape[2]) < pos]
    elif plan.kind == "block_sparse":
        rank_BKNE = kv.ksum
        if plan.rank == "nsa_prob":  # block means, the own block's complete with this key
            own_sum_BK1E = jnp.sum(_block_with_own_row(kv.k, k_BK1E, pos, plan.block_size).astype(jnp.float32), axis=2, keepdims=True)
            rank_BKNE = cache_lib.with_completed_block(kv.ksum, own_sum_BK1E, pos, plan.block_size) / plan.block_size
        rows_BKS = _selected_rows(plan, q_B1HE, rank_BKNE, pos)
        keys, values = [_take_rows(kv.k, rows_BKS)], [_take_rows(kv.v, rows_BKS)]
        valid = [((rows_BKS >= 0) & (rows_BKS < pos))[:, :, None, :]]
    else:
        d_S = np.asarray(plan.distances[1:])  # distances are sorted and start at 0 (the window)
        keys, values, valid = [_rows(kv.k, pos - d_S)], [_rows(kv.v, pos - d_S)], [pos >= d_S]
    keys, values, valid = [k_BK1E, *keys], [v_BK1E, *values], [np.ones(1, bool), *valid]
    scores = [_scores(q_BKGE, k) for k in keys]
    learned = plan.kind == "interpolated" and bool(plan.slots)
    if learned:
        lo_R, frac_R, active_R = traced_rung_taps(attn.alpha(), plan.slots, window=plan.window, seq_len=plan.max_len)
        near_R, far_R = pos - lo_R, jnp.maximum(pos - lo_R - 1, 0)  # far neighbour clamped at position 0
        s_near, s_far = _scores(q_BKGE, _rows(kv.k, near_R)), _scores(q_BKGE, _rows(kv.k, far_R))
        scores.append(s_near + frac_R * (s_far - s_near))  # the score is linear in the key
        valid.append((pos >= lo_R) & active_R)
    valid = [jnp.broadcast_to(m, (b, kv.k.shape[1], 1, m.shape[-1])) for m in valid]  # [S] or [B, K, 1, S] pieces
    p_BKGS, _ = masked_softmax(jnp.concatenate(scores, -1), jnp.concatenate(valid, -1))
    o_BKGE, col = 0.0, 0
    for v in values:
        o_BKGE += _values(p_BKGS[..., col : col + v.shape[2]], v)
        col += v.shape[2]
    if learned:
        p_BKGR = p_BKGS[..., col:]
        o_BKGE += _values(p_BKGR * (1 - frac_R), _rows(kv.v, near_R)) + _values(p_BKGR * frac_R, _rows(kv.v, far_R))
    return o_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


# --- layer modes: the model's own blocks run with these in place of their attention ---------


class PromptMode(NamedTuple):
    """A ``fibjax.layer_modes`` mode for the prompt: each layer attends as ``attend_prompt`` and
    records its cache (``sow`` "cache"), so prefill is the model's own forward."""

    plans: tuple[LayerPlan, ...]

    def __call__(self, attn, q_BPHE: Array, k_BPKE: Array, v_BPKE: Array, x_BPD: Array) -> Array:
        plan = self.plans[attn.layer]
        compressed = (attn.nsa.k_compress(k_BPKE), attn.nsa.v_compress(v_BPKE)) if plan.kind == "nsa" else None
        attn.sow(nnx.Intermediate, "cache", cache_lib.from_prompt(plan, k_BPKE, v_BPKE, compressed))
        return attend_prompt(plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD)


class TokenMode(NamedTuple):
    """The mode of one decoding step at ``pos``: each layer reads its ``cache`` entry as
    ``attend_token`` and records the entry with this position written (``sow`` "cache")."""

    plans: tuple[LayerPlan, ...]
    cache: tuple[KV, ...]
    pos: Array

    def __call__(self, attn, q_B1HE: Array, k_B1KE: Array, v_B1KE: Array, x_B1D: Array) -> Array:
        plan, kv = self.plans[attn.layer], self.cache[attn.layer]
        compressed = None
        if plan.kind == "nsa":
            out_B1HE, compressed = attend_nsa_token(plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, self.pos)
        else:
            out_B1HE = attend_token(plan, attn, q_B1HE, k_B1KE, v_B1KE, kv, self.pos)
        write = cache_lib.write_token(kv, k_B1KE, v_B1KE, self.pos, after=out_B1HE, block_size=plan.block_size, compressed=compressed)
        attn.sow(nnx.Intermediate, "cache", write)
        return out_B1HE
