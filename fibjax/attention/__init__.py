"""fibjax.attention: paper A's attended sets and every attention path (public API).

>>> from fibjax.attention import attended_distances, offset_attention
>>> ds = attended_distances(window=12, base="fibonacci", alpha=1.0, seq_len=1024)

The pure-Python offset math (``fibjax.attention.offsets``) imports no JAX; the attention
functions load JAX and the kernels on first use (PEP 562 module ``__getattr__``), so a config
file or a planning tool can use the geometry without starting JAX.
"""

from __future__ import annotations

import importlib

from fibjax.attention.offsets import (
    FIBONACCI_RUNGS,
    alpha_schedule,
    alpha_to_logit,
    alpha_to_theta,  # the earlier name of alpha_to_logit
    attended_distances,
    base_rungs,
    bounded_base,
    coprime_stride,
    learned_rung_bases,  # the earlier names of rung_slots and rung_taps
    learned_rung_spec,
    rung_slots,
    rung_taps,
)

# name -> the submodule that defines it (imported when first asked for)
_LAZY = {
    "dense_attention": "fibjax.attention.api",
    "interpolated_attention": "fibjax.attention.api",
    "offset_attention": "fibjax.attention.api",
    "block_sparse_attention": "fibjax.attention.block_sparse",
    "dropped_mass": "fibjax.attention.block_sparse",
    "select_blocks": "fibjax.attention.block_sparse",
    "compress_blocks": "fibjax.attention.nsa",
    "nsa_attention": "fibjax.attention.nsa",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fibjax.attention' has no attribute {name!r}")


__all__ = [
    "FIBONACCI_RUNGS",
    "alpha_schedule",
    "alpha_to_logit",
    "alpha_to_theta",
    "attended_distances",
    "base_rungs",
    "block_sparse_attention",
    "bounded_base",
    "compress_blocks",
    "coprime_stride",
    "dense_attention",
    "dropped_mass",
    "interpolated_attention",
    "learned_rung_bases",
    "learned_rung_spec",
    "nsa_attention",
    "offset_attention",
    "rung_slots",
    "rung_taps",
    "select_blocks",
]
