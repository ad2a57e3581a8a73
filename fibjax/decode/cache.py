"""What each layer caches while decoding, decided once per (model, capacity) on the host.

The attended set during generation is the set of a full forward at the decode's *capacity*
L = ``max_len`` (the prompt plus every token that may be generated): every position, prompt
and generated alike, attends what the layer attends in a forward of L tokens, so the cached
logits equal a full forward's logits row for row. Each layer's kind (``fibjax.kinds``) makes its
plan at L (``LayerPlan``: the cache rows and what its steps need) and says what its cache holds:
dense and block-sparse layers a row per position (block-sparse also each block's key sum, NSA
each block's compressed key and value), offset layers a ring buffer as long as their farthest
distance (position p in row p mod rows). Every buffer is capped at L rows (a buffer of L rows
never wraps), except that block kinds round L up to whole blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from fibjax import kinds
from fibjax.kinds.base import KV, LayerPlan

if TYPE_CHECKING:
    from flax import nnx

Cache = tuple  # one entry per layer: its kind's cache tuple (k, v first)

__all__ = ["KV", "Cache", "LayerPlan", "cache_bytes", "init_cache", "plan_layers"]


def plan_layers(model: nnx.Module, max_len: int) -> tuple[LayerPlan, ...]:
    """The plan of every layer of a ``fibjax.model.Transformer`` decoding up to ``max_len`` tokens.

    Args:
        model: The model.
        max_len: The decode's capacity in tokens (>= 2).

    Returns:
        One [LayerPlan][fibjax.kinds.LayerPlan] per layer.

    Raises:
        ValueError: ``max_len < 2``.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a prompt token and a new one), got {max_len}")
    return tuple(kinds.kind_of(block.attn.cfg.attention).plan(block.attn, max_len) for block in model.blocks)


def init_cache(plans: tuple[LayerPlan, ...], batch: int, kv_heads: int, head_dim: int, dtype) -> Cache:
    """Every layer's empty cache."""
    return tuple(p.kind.init_cache(p, batch, kv_heads, head_dim, dtype) for p in plans)


def cache_bytes(cache: Cache) -> int:
    """The bytes a cache holds, every layer's arrays together.

    Args:
        cache: The cache.

    Returns:
        The bytes.
    """
    return sum(x.nbytes for x in jax.tree.leaves(cache))
