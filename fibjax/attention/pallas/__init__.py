"""Pallas kernels for the offset paths (static distances and learned alpha), forward and
backward, and for block-sparse attention (``block_ops``, imported from there).

On GPU they lower through Pallas' Triton backend, on TPU through Mosaic; on CPU they run in
interpret mode (correct, slow: for tests). The offset functions of ``fibjax.attention.api``
dispatch here when asked, with ``implementation="pallas"`` (config:
``model.attention.implementation=pallas``). The kernels are the default nowhere yet: ``implementation=None`` picks them only on a platform listed in
``backend.PALLAS_BY_DEFAULT``, which stays empty until a platform's hardware check has passed
(``launch/gpu_check.sh``, ``launch/tpu_check.sh``), so None means the XLA path everywhere.
"""

from fibjax.attention.pallas.backend import BlockSizes, default_backend
from fibjax.attention.pallas.ops import interpolated_attention_pallas, offset_attention_pallas

__all__ = ["BlockSizes", "default_backend", "interpolated_attention_pallas", "offset_attention_pallas"]
