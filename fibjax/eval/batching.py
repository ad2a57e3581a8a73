"""Running a model over many token rows, the one way every evaluation does it: a function of the
model jitted once per architecture, called on batches of one fixed size (one compile per row
length), the batches split over a mesh's data axes when there is one.

The mesh may span processes (a pod): every process holds the same rows and parameters, each
device computes its share of a batch, and every process gets the whole batch's results back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from fibjax.attention.sharded import BATCH_AXES
from fibjax.config import ModelConfig
from fibjax.model import graphdef_of

RowFn = Callable[[object, np.ndarray], np.ndarray]  # (params, rows [N, L]) -> per-row results [N, ...]


@functools.lru_cache(maxsize=32)
def on_model(model_cfg: ModelConfig, head: Callable) -> Callable:
    """``jit((params, tokens) -> head(model, tokens))`` for this architecture. ``head`` must be a
    module-level function (it keys the cache: one compile per architecture and head)."""
    graphdef = graphdef_of(model_cfg)
    return jax.jit(lambda params, tokens: head(nnx.merge(graphdef, params), tokens))


def next_token_nll(model, tokens_BL1: jax.Array) -> jax.Array:
    """NLL [B, L] float32 of each next token (model.logits_chunk bounds the logits' memory)."""
    return model(tokens_BL1[:, :-1], targets_BT=tokens_BL1[:, 1:])


def argmax_next(model, tokens_BL: jax.Array) -> jax.Array:
    """The argmax next token [B, L] int32 at every position."""
    return jnp.argmax(model(tokens_BL), axis=-1).astype(jnp.int32)


def mesh_devices(mesh: jax.sharding.Mesh | None) -> int:
    """How many devices (of every process) an evaluation ran on: reports record it."""
    return 1 if mesh is None else mesh.devices.size


def batch_shards(mesh: jax.sharding.Mesh | None) -> int:
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES)


def fixed_batch_size(rows: int, mesh: jax.sharding.Mesh | None) -> int:
    """``rows`` rounded up to a whole number of rows per batch shard."""
    shards = batch_shards(mesh)
    return -(-max(1, rows) // shards) * shards


def _global(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same value in every process) as one array laid out by ``sharding``, which may
    span processes: each process supplies its own devices' slices."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _fetch(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` on this host, also where other processes hold parts of it."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def replicate(params, mesh: jax.sharding.Mesh | None):
    """The parameters on every device of the mesh (data-parallel evaluation), or unchanged."""
    if mesh is None:
        return params
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: _global(x, everywhere), params)


def in_fixed_batches(fn: RowFn, params, rows_NL: np.ndarray, batch: int, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    """``fn`` over every row, ``batch`` rows per call: the last call padded by repeating its last
    row (its results dropped), so that a row length compiles once. With a mesh (``batch`` a
    multiple of ``batch_shards``), each batch is split over the data axes."""
    outs = []
    for start in range(0, len(rows_NL), batch):
        chunk = rows_NL[start : start + batch]
        real = len(chunk)
        if real < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
        if mesh is not None:
            chunk = _global(chunk, NamedSharding(mesh, PartitionSpec(BATCH_AXES)))
        outs.append(_fetch(fn(params, chunk))[:real])
    return np.concatenate(outs)
