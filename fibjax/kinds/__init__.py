"""fibjax.kinds: each attention kind as one object, and the registry that maps names to them.

Built in: ``dense``, ``offset`` (paper A; learned or interpolated alpha runs as the
``interpolated`` variant), ``block_sparse`` (MoBA, paper B) and ``nsa``. A new kind is one
[AttentionKind][fibjax.kinds.AttentionKind] subclass and one [register][fibjax.kinds.register] call; the model, the decoder, the
evaluator, the probe, the reports and the benchmarks then take it by name
(``model.attention.kind=<name>``). ``docs/guides/attention-in-your-model.md`` has an example.

The registry imports no JAX (a config names its kind without starting it); the kinds do, when
first asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fibjax.kinds.registry import DEFAULT_SPARSE, FULL, get, kind_of, names, register, unregister

if TYPE_CHECKING:
    from fibjax.kinds.base import KV, AttentionKind, LayerPlan

_LAZY = {"AttentionKind": "fibjax.kinds.base", "KV": "fibjax.kinds.base", "LayerPlan": "fibjax.kinds.base"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fibjax.kinds' has no attribute {name!r}")


__all__ = ["AttentionKind", "DEFAULT_SPARSE", "FULL", "KV", "LayerPlan", "get", "kind_of", "names", "register", "unregister"]
