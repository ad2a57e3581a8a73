"""Pallas kernels for the offset paths (static distances and learned alpha), forward and backward.

On GPU they lower through Pallas' Triton backend, on TPU through Mosaic; on CPU they run in
interpret mode (correct, slow: for tests). ``fibjax.attention.api`` dispatches here with
``implementation="pallas"`` (the default on GPU and TPU).
"""

from fibjax.attention.pallas.backend import BlockSizes, default_backend
from fibjax.attention.pallas.ops import interpolated_attention_pallas, offset_attention_pallas

__all__ = ["BlockSizes", "default_backend", "interpolated_attention_pallas", "offset_attention_pallas"]
