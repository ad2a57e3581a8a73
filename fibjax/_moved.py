"""Modules that moved keep their old import path for a while: a module ``__getattr__`` that
finds each name at its new home and says where, with a DeprecationWarning; removed in 0.3.0 (CHANGELOG.md, "Deprecated")."""

from __future__ import annotations

import importlib
import warnings


def forward_to(old: str, *new: str, names: frozenset[str] | None = None):
    """A module ``__getattr__`` for the module ``old`` whose names (all, or only ``names``) now
    live in the modules ``new`` (searched in order): each use warns, naming the new module, and
    returns the object itself."""

    def __getattr__(name: str):
        wanted = not name.startswith("__") and (names is None or name in names)
        for module_name in new if wanted else ():
            module = importlib.import_module(module_name)
            if hasattr(module, name):
                warnings.warn(f"{old}.{name} has moved: use {module_name}.{name}", DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
