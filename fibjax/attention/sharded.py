"""Run an attention call per device shard under the active mesh (for the Pallas kernels).

XLA cannot partition a Pallas custom call, so under a sharded ``jit`` it would gather whole
tensors onto every device. Attention is independent per (batch row, head), so we split the
batch over the mesh's batch axes and the heads over its tensor axis with ``shard_map`` and run
the kernel on each shard: the result is the same function, computed where the data lives. An
axis that does not divide its dimension is left unsplit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

# The mesh's axis names, defined here (the lowest layer that needs them) and used by train.sharding.
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


def batch_axes(mesh, batch: int) -> tuple[str, ...]:
    """The mesh's batch axes (size > 1) to split a batch of ``batch`` rows over: all of them when
    their product divides it, else none (the batch is left whole)."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    return axes if batch % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def per_shard(fn: Callable, q, k, v, *scalars, return_lse: bool, whole_groups: bool = False):
    """``fn(q, k, v, *scalars)`` on each shard of the active mesh (the call itself without one).

    ``scalars`` (e.g. a traced alpha) are replicated; q [B,T,H,D], k/v [B,T,K,D]. Heads split
    over the tensor axis: the KV heads when it divides them; else, with GQA, the query heads when
    each shard's query heads share one KV head (the shard takes that head's k/v: split query
    heads, k/v replicated over the tensor axis); else nothing is split there (replicated work).
    ``whole_groups``: never split a KV head's query heads (block-sparse attention chooses its
    blocks from the sum over the whole group)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return fn(q, k, v, *scalars)
    batch = batch_axes(mesh, q.shape[0])
    tensor, h, kh = mesh.shape.get(HEAD_AXIS, 1), q.shape[2], k.shape[2]
    q_head = kv_head = None
    if tensor > 1 and kh % tensor == 0:
        q_head = kv_head = HEAD_AXIS
    elif tensor > 1 and not whole_groups and h % tensor == 0 and (h // kh) % (h // tensor) == 0:
        q_head, fn = HEAD_AXIS, _own_kv_head(fn, h // tensor, h // kh)
    q_spec, kv_spec = P(batch or None, None, q_head, None), P(batch or None, None, kv_head, None)
    out_spec = (q_spec, P(batch or None, None, q_head)) if return_lse else q_spec
    in_specs = (q_spec, kv_spec, kv_spec) + (P(),) * len(scalars)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(q, k, v, *scalars)


def _own_kv_head(fn: Callable, heads_per_shard: int, group: int) -> Callable:
    """``fn`` on this shard's query heads and the one KV head they share: shard i holds query
    heads [i * Hs, (i + 1) * Hs), all in group (i * Hs) // G (G a multiple of Hs)."""

    def on_shard(q, k, v, *scalars):
        kv = jax.lax.axis_index(HEAD_AXIS) * heads_per_shard // group
        pick = lambda x: jax.lax.dynamic_slice_in_dim(x, kv, 1, axis=2)  # noqa: E731
        return fn(q, pick(k), pick(v), *scalars)

    return on_shard
