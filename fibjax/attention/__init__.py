"""fibjax.attention: paper A's attended sets and every attention path (public API).

>>> from fibjax.attention import attended_distances, offset_attention
>>> ds = attended_distances(window=12, base="fibonacci", alpha=1.0, seq_len=1024)

The pure-Python offset and alpha math (``offsets``, ``alpha``) imports no JAX; the attention
functions load JAX and the kernels on first use (PEP 562 module ``__getattr__``), so a config
file or a planning tool can use the geometry without starting JAX.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

from fibjax.attention.alpha import alpha_schedule, alpha_to_logit, coprime_stride, logit_to_alpha
from fibjax.attention.offsets import FIBONACCI_RUNGS, attended_distances, base_rungs, bounded_base, rung_slots, rung_taps

if TYPE_CHECKING:
    from fibjax.attention.api import block_sparse_attention, dense_attention, interpolated_attention, offset_attention
    from fibjax.attention.block_sparse import dropped_mass, select_blocks
    from fibjax.attention.nsa import compress_blocks, nsa_attention
    from fibjax.attention.window import sinks_attention, window_attention

# name -> the submodule that defines it (imported when first asked for)
_LAZY = {
    "dense_attention": "fibjax.attention.api",
    "interpolated_attention": "fibjax.attention.api",
    "offset_attention": "fibjax.attention.api",
    "block_sparse_attention": "fibjax.attention.api",
    "dropped_mass": "fibjax.attention.block_sparse",
    "select_blocks": "fibjax.attention.block_sparse",
    "compress_blocks": "fibjax.attention.nsa",
    "nsa_attention": "fibjax.attention.nsa",
    "window_attention": "fibjax.attention.window",
    "sinks_attention": "fibjax.attention.window",
}


# earlier names -> their present names (a DeprecationWarning on use; removed in 0.3.0, CHANGELOG.md)
_RENAMED = {"alpha_to_theta": "alpha_to_logit", "learned_rung_bases": "rung_slots", "learned_rung_spec": "rung_taps"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"fibjax.attention.{name} is deprecated: use fibjax.attention.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'fibjax.attention' has no attribute {name!r}")


__all__ = [
    "FIBONACCI_RUNGS",
    "alpha_schedule",
    "alpha_to_logit",
    "attended_distances",
    "base_rungs",
    "block_sparse_attention",
    "bounded_base",
    "compress_blocks",
    "coprime_stride",
    "dense_attention",
    "dropped_mass",
    "interpolated_attention",
    "logit_to_alpha",
    "nsa_attention",
    "offset_attention",
    "rung_slots",
    "rung_taps",
    "select_blocks",
    "sinks_attention",
    "window_attention",
]
