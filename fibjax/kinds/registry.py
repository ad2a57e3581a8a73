"""Attention kinds by name: the one place that maps ``model.attention.kind`` to its object.

The built-in kinds are imported on first use (their modules load JAX), so the config can
validate a kind's name without starting JAX. A kind of your own is one object registered by name:

>>> from fibjax.kinds import registry
>>> registry.register(MyKind())          # doctest: +SKIP
>>> AttentionConfig(kind="my_kind")      # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fibjax.kinds.base import AttentionConfig, AttentionKind

# name -> "module:attribute" of the built-in kinds, imported when first asked for
_BUILTIN = {
    "dense": "fibjax.kinds.dense:DENSE",
    "offset": "fibjax.kinds.offset:OFFSET",
    "block_sparse": "fibjax.kinds.block_sparse:BLOCK_SPARSE",
    "nsa": "fibjax.kinds.nsa:NSA_KIND",
    "window": "fibjax.kinds.window:WINDOW",
    "sinks": "fibjax.kinds.window:SINKS",
}
# the least value of a config field a built-in kind accepts, checked by the config without
# importing the kind (its module loads JAX); other kinds' fields only need to be >= 0
_MINIMUMS = {"window": {"window": 1}, "sinks": {"window": 1, "sinks": 1}}
# variants a registered kind hands a config to (``resolve``); not names a config may give
_VARIANTS = {"interpolated": "fibjax.kinds.interpolated:INTERPOLATED"}
_KINDS: dict[str, AttentionKind] = {}

# --inference-mode full: every key (the kind SSA's full stream runs)
FULL = "dense"
# The sparse attention a dense-trained model is evaluated under by --inference-mode sparse
# (paper B's "attention gap": MoBA blocks with the config's block budget).
DEFAULT_SPARSE = "block_sparse"
# The kind a transformers ``sliding_window`` (Mistral's) imports onto: the last W keys, itself included
SLIDING_WINDOW = "window"


def register(kind: AttentionKind, *, replace: bool = False) -> AttentionKind:
    """Make ``kind`` available as ``model.attention.kind=<kind.name>``.

    Args:
        kind: The kind; its ``name`` is what configs give.
        replace: Replace a different kind registered under the same name.

    Returns:
        ``kind``.

    Raises:
        ValueError: Another kind has that name and ``replace`` is False.
    """
    name = kind.name
    if not replace and name in names() and get(name) is not kind:
        raise ValueError(f"an attention kind named {name!r} is already registered (pass replace=True to replace it)")
    _KINDS[name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind registered with [register][fibjax.kinds.register] (a test's toy kind, say).

    Args:
        name: The kind's name (unknown names are ignored).

    Raises:
        ValueError: ``name`` is a built-in kind.
    """
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in attention kind")
    _KINDS.pop(name, None)


def names() -> tuple[str, ...]:
    """The names of every kind a config may give: the built-in ones, then those registered.

    Returns:
        The names, in that order.
    """
    return tuple(dict.fromkeys((*_BUILTIN, *_KINDS)))


def _load(path: str) -> AttentionKind:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def get(name: str) -> AttentionKind:
    """The kind registered as ``name`` (KeyError naming the known kinds otherwise).

    Args:
        name: The kind's name.

    Returns:
        The kind (a built-in one imported on first use).

    Raises:
        KeyError: No kind has that name.
    """
    if name not in _KINDS:
        if name not in _BUILTIN:
            raise KeyError(f"unknown attention kind {name!r}; known: {', '.join(names())}")
        _KINDS[name] = _load(_BUILTIN[name])
    return _KINDS[name]


def minimums(name: str) -> dict[str, int]:
    """{field: least value} that kind ``name`` needs of its ``AttentionConfig`` fields."""
    return _MINIMUMS.get(name, {})


def variant(name: str) -> AttentionKind:
    """A built-in variant that a kind's ``resolve`` hands a config to (``interpolated``: offsets with
    learned or interpolated alpha). Looked up here so that a kind and its variant, which subclasses
    it, do not import each other."""
    return _load(_VARIANTS[name])


def kind_of(acfg: AttentionConfig) -> AttentionKind:  # noqa: DOC502
    """The kind that runs an ``AttentionConfig`` (a kind may hand a config to a variant: offsets
    with learned or interpolated alpha run as the interpolated kind).

    Args:
        acfg: An ``AttentionConfig``.

    Returns:
        The kind (or its variant) that runs it.

    Raises:
        KeyError: ``acfg.kind`` names no kind.
    """
    return get(acfg.kind).resolve(acfg)
