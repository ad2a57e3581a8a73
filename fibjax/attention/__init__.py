"""fibjax.attention: paper A's attended sets and every attention path (public API).

>>> from fibjax.attention import attended_distances, offset_attention
>>> ds = attended_distances(window=12, base="fibonacci", alpha=1.0, seq_len=1024)
"""

from fibjax.attention.api import dense_attention, interpolated_attention, offset_attention
from fibjax.attention.block_sparse import block_sparse_attention, dropped_mass, select_blocks
from fibjax.attention.offsets import (
    FIBONACCI_RUNGS,
    alpha_schedule,
    alpha_to_theta,
    attended_distances,
    base_rungs,
    bounded_base,
    coprime_stride,
    learned_rung_bases,
    learned_rung_spec,
)

__all__ = [
    "FIBONACCI_RUNGS",
    "alpha_schedule",
    "alpha_to_theta",
    "attended_distances",
    "base_rungs",
    "block_sparse_attention",
    "bounded_base",
    "coprime_stride",
    "dense_attention",
    "dropped_mass",
    "interpolated_attention",
    "learned_rung_bases",
    "learned_rung_spec",
    "offset_attention",
    "select_blocks",
]
