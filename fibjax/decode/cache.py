"""What each layer caches while decoding, decided once per (model, capacity) on the host.

The attended set during generation is the set of a full forward at the decode's *capacity*
L = ``max_len`` (the prompt plus every token that may be generated): every position, prompt
and generated alike, attends ``attended_distances(..., seq_len=L)`` (static layers) or the
learned rung slots at L. A full forward over the same L tokens computes exactly this, so the
cached logits equal its logits row for row. For Fibonacci and explicit bases the set restricted
to the keys a position can see does not depend on L at all; only pow2 (reach-matched: its
rungs are the powers of two <= L-1) changes with the capacity.

Per layer (``LayerPlan``):

* ``dense``: one row per position, L rows;
* ``block_sparse``: block-sparse attention (MoBA / SSA's sparse stream): one row per position, and
  the key sum of every completed block, written once when its last position is (``ksum``), so a
  step scores L / block_size block sums and reads only the selected blocks' rows;
* ``nsa``: one row per position, and the compressed key and value of every completed block
  (``kcmp``, ``vcmp``: the layer's learned compression of that block, computed once, in the step
  that completes it), which the compressed branch attends and the selection ranks;
* ``offset``: a ring buffer of max(distances) + 1 rows; position p lives in row p mod rows;
* ``interpolated``: window {0..W} plus interpolated rung slots whose lo is computed from the layer's
  current alpha inside the step (as the full forward does); the buffer holds the largest
  reachable distance lo_max + 1 (the far neighbour) of that alpha, plus one row of margin
  against a one-ulp difference in alpha between the host plan and the jitted step.

Every buffer is capped at L rows (a buffer of L rows never wraps), except that the block kinds
round L up to whole blocks (a step reads the whole block of its position). Letters: B batch, M cache
rows, K KV heads, E head dim, P prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention import offsets
from fibjax.attention.block_sparse import num_earlier_blocks
from fibjax.attention.offset_xla import traced_rung_taps

Array = jax.Array

LEARNED_MARGIN_ROWS = 1


@dataclass(frozen=True)
class LayerPlan:
    """One layer's cache and attended set at capacity ``max_len`` (hashable: a static value)."""

    kind: str  # as the layer's attention: "dense" | "offset" | "interpolated" | "block_sparse" | "nsa"
    rows: int  # cache rows (the ring buffer's length)
    max_len: int
    distances: tuple[int, ...] = ()  # offset: the attended set; interpolated: the window {0..W}
    base_rungs: tuple[int, ...] = ()  # interpolated: the base rungs at max_len, as an explicit base
    slots: tuple[int, ...] = ()  # interpolated: the rung slots (the rungs some alpha can activate)
    window: int = 0
    block_size: int = 0  # block_sparse, nsa: keys per block
    top: int = 0  # block_sparse, nsa: earlier blocks selected besides the own one (as the full forward at max_len)
    rank: str = "mean_key"  # block_sparse: the block_rank rule; nsa: nsa_prob over the compressed keys


class KV(NamedTuple):
    """One layer's cache: k, v [B, K, M, E] (heads before rows: the layout the single-query
    matmuls read without a transposed copy of the cache); position p is row p % M. Block-sparse
    layers also keep ksum [B, K, N, E] float32, the key sum of each completed block; NSA layers
    kcmp, vcmp [B, K, N, E], each completed block's compressed key and value."""

    k: Array
    v: Array
    ksum: Array | None = None
    kcmp: Array | None = None
    vcmp: Array | None = None


Cache = tuple[KV, ...]


def plan_layers(model, max_len: int) -> tuple[LayerPlan, ...]:
    """The plan of every layer of a ``fibjax.model.Transformer`` decoding up to ``max_len`` tokens."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a prompt token and a new one), got {max_len}")
    return tuple(_plan_layer(block.attn, max_len) for block in model.blocks)


def _plan_layer(attn, max_len: int) -> LayerPlan:
    acfg = attn.cfg.attention
    if acfg.kind == "dense":
        return LayerPlan("dense", max_len, max_len)
    if acfg.kind in ("block_sparse", "nsa"):
        top = num_earlier_blocks(max_len, acfg.block_size, acfg.num_blocks)
        rank = "nsa_prob" if acfg.kind == "nsa" else acfg.block_rank
        whole_blocks = -(-max_len // acfg.block_size) * acfg.block_size  # a step slices its position's whole block
        return LayerPlan(acfg.kind, whole_blocks, max_len, block_size=acfg.block_size, top=top, window=acfg.window, rank=rank)
    if acfg.kind != "offset":
        raise NotImplementedError(f"decoding a {acfg.kind!r} layer is not available (fibjax/decode/cache.py, _plan_layer)")
    if not acfg.is_interpolated:
        ds = offsets.attended_distances(window=acfg.window, base=acfg.bounded_base, alpha=attn.alpha(), seq_len=max_len)
        ds = tuple(d for d in ds if d < max_len)  # window distances past the capacity are never valid
        return LayerPlan("offset", max(ds) + 1, max_len, distances=ds)
    window = tuple(range(min(acfg.window, max_len - 1) + 1))
    rungs = offsets.base_rungs(acfg.bounded_base, max_len)
    slots = offsets.rung_slots(window=acfg.window, base=rungs, seq_len=max_len)
    reach = window[-1]
    if slots:
        spec = jax.jit(lambda a: traced_rung_taps(a, slots, window=acfg.window, seq_len=max_len))(attn.alpha())
        active_lo = np.asarray(spec.lo)[np.asarray(spec.active)]
        if active_lo.size:
            reach = max(reach, int(active_lo.max()) + 1 + LEARNED_MARGIN_ROWS)
    return LayerPlan("interpolated", min(reach + 1, max_len), max_len, distances=window, base_rungs=rungs, slots=slots, window=acfg.window)


def num_block_sums(plan: LayerPlan) -> int:
    return -(-plan.max_len // plan.block_size)


def init_cache(plans: tuple[LayerPlan, ...], batch: int, kv_heads: int, head_dim: int, dtype) -> Cache:
    """Zeros for every layer (the rows a position has not written yet are never attended)."""

    def empty(p: LayerPlan) -> KV:
        k, v = (jnp.zeros((batch, kv_heads, p.rows, head_dim), dtype) for _ in range(2))
        ksum = jnp.zeros((batch, kv_heads, num_block_sums(p), head_dim), jnp.float32) if p.kind == "block_sparse" else None
        kcmp, vcmp = (jnp.zeros((batch, kv_heads, num_block_sums(p), head_dim), dtype) for _ in range(2)) if p.kind == "nsa" else (None, None)
        return KV(k, v, ksum, kcmp, vcmp)

    return tuple(empty(p) for p in plans)


def write_token(kv: KV, k_B1KE: Array, v_B1KE: Array, pos: Array, *, after: Array, block_size: int = 0, compressed: tuple[Array, Array] | None = None) -> KV:
    """Store the key/value of position ``pos`` (traced) in its row ``pos % M``, once ``after``
    (the attention output that read the old cache) is computed; a block-sparse layer's block
    sum is written when ``pos`` completes its block; an NSA layer's ``compressed`` (kcmp, vcmp),
    computed by the step with this block completed, replace the old ones.

    The write takes a zero made from ``after`` (x * 0 is not folded for floats), so it depends
    on every read of the cache. Without that order XLA:CPU copies each donated cache once or
    twice per step (the whole dense cache per token, 30 ms at 64k tokens here) instead of
    updating one row in place.
    """
    row = pos % kv.k.shape[2]
    zero = after.reshape(after.shape[0], 1, 1, -1)[..., :1] * 0
    k, v = (
        jax.lax.dynamic_update_slice_in_dim(c, jnp.swapaxes(x + zero.astype(x.dtype), 1, 2).astype(c.dtype), row, axis=2)
        for c, x in ((kv.k, k_B1KE), (kv.v, v_B1KE))
    )
    ksum = kv.ksum
    if ksum is not None:
        # the block's rows (this one just written), summed as the full forward sums a block
        start = pos // block_size * block_size
        sum_BK1E = jnp.sum(jax.lax.dynamic_slice_in_dim(k, start, block_size, axis=2).astype(jnp.float32), axis=2, keepdims=True)
        ksum = with_completed_block(ksum, sum_BK1E, pos, block_size)
    kcmp, vcmp = compressed if compressed is not None else (kv.kcmp, kv.vcmp)
    return KV(k, v, ksum, kcmp, vcmp)


def with_completed_block(per_block_BKNE: Array, new_BK1E: Array, pos: Array, block: int) -> Array:
    """``per_block`` with entry pos // block replaced by ``new`` iff ``pos`` completes its block
    (a block's sum or compressed key is written once, by the step of its last position)."""
    old_BK1E = jax.lax.dynamic_slice_in_dim(per_block_BKNE, pos // block, 1, axis=2)
    done = (pos + 1) % block == 0
    return jax.lax.dynamic_update_slice_in_dim(per_block_BKNE, jnp.where(done, new_BK1E.astype(old_BK1E.dtype), old_BK1E), pos // block, axis=2)


def from_prompt(plan: LayerPlan, k_BPKE: Array, v_BPKE: Array, compressed: tuple[Array, Array] | None = None) -> KV:
    """The cache after a prompt of P tokens: its last min(P, M) positions in rows p % M (and the
    sums of the prompt's completed blocks; for NSA ``compressed``, the prompt's compressed blocks
    [B, P // block, K, E] as the layer computes them)."""
    b, p, kh, e = k_BPKE.shape
    keep = min(p, plan.rows)
    rows = np.arange(p - keep, p) % plan.rows
    k, v = (jnp.zeros((b, kh, plan.rows, e), x.dtype).at[:, :, rows].set(jnp.swapaxes(x[:, p - keep :], 1, 2)) for x in (k_BPKE, v_BPKE))
    ksum = None
    if plan.kind == "block_sparse":
        done = p // plan.block_size
        sums_BKNE = jnp.sum(jnp.swapaxes(k[:, :, : done * plan.block_size], 1, 2).reshape(b, done, plan.block_size, kh, e).astype(jnp.float32), axis=2)
        ksum = jnp.zeros((b, kh, num_block_sums(plan), e), jnp.float32).at[:, :, :done].set(jnp.swapaxes(sums_BKNE, 1, 2))
    kcmp = vcmp = None
    if plan.kind == "nsa":
        kcmp, vcmp = (jnp.zeros((b, kh, num_block_sums(plan), e), x.dtype).at[:, :, : x.shape[1]].set(jnp.swapaxes(x, 1, 2)) for x in compressed)
    return KV(k, v, ksum, kcmp, vcmp)


def cache_bytes(cache: Cache) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(cache))
