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


def per_shard(fn: Callable, q, k, v, *scalars, return_lse: bool):
    """``fn(q, k, v, *scalars)`` on each shard of the active mesh (the call itself without one).

    ``scalars`` (e.g. a traced alpha) are replicated; q [B,T,H,D], k/v [B,T,K,D]."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return fn(q, k, v, *scalars)
    batch = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if q.shape[0] % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    tensor = mesh.shape.get(HEAD_AXIS, 1)
    head = HEAD_AXIS if tensor > 1 and k.shape[2] % tensor == 0 else None
    qkv_spec = P(batch or None, None, head, None)
    out_spec = (qkv_spec, P(batch or None, None, head)) if return_lse else qkv_spec
    in_specs = (qkv_spec,) * 3 + (P(),) * len(scalars)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(q, k, v, *scalars)
