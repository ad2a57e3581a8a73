"""Lazy exports for a package whose ``__init__`` must stay light (no JAX or Orbax on import):
its ``__all__`` names objects of its modules, imported when first asked for. The package also
imports them under ``if TYPE_CHECKING:``, so type checkers and the API reference (griffe,
mkdocstrings) see them without running anything."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, homes: dict[str, str]):
    """A module ``__getattr__`` for ``package``: name -> the module in ``homes`` defining it."""

    def __getattr__(name: str):
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
