"""Alpha, the per-layer scale of paper A's rungs: schedules, the learned parameter's logit, and
every layer's value as a model holds it. Pure Python (JAX only for a traced logit).

A learned layer holds ``alpha_logit`` with alpha = 0.5 + sigmoid(alpha_logit), so alpha always
lies inside (0.5, 1.5); the logit of a starting alpha is taken after pulling it 0.05 inside that
span (sigmoid never reaches 0 or 1), so a learned run's true starting alphas are
``initial_alphas``, not the schedule's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

ALPHA_MIN, ALPHA_MAX = 0.5, 1.5
SCHEDULES = ("fixed", "staggered", "coprime", "learned")
LOGIT_MARGIN = 0.05
PARAM = "alpha_logit"  # the learned layer's parameter: params["blocks"][i]["attn"][PARAM]


def coprime_stride(num_layers: int) -> int:
    """Largest s in [2, L // 2] with gcd(s, L) = 1, or 1 (the linear order) when none exists.

    Args:
        num_layers: The number of layers L.

    Returns:
        The stride s (1 when no s in [2, L // 2] is coprime with L).
    """
    return next((s for s in range(num_layers // 2, 1, -1) if math.gcd(s, num_layers) == 1), 1)


def alpha_schedule(schedule: str, num_layers: int) -> tuple[float, ...]:
    """Per-layer alpha for ``schedule`` in fixed | staggered | coprime | learned (its initial values).

    Args:
        schedule: ``"fixed"``, ``"staggered"``, ``"coprime"`` or ``"learned"``.
        num_layers: The number of layers.

    Returns:
        One alpha per layer.

    Raises:
        ValueError: ``num_layers < 1`` or an unknown ``schedule``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if schedule in ("fixed", "learned"):
        return (1.0,) * num_layers
    if schedule not in ("staggered", "coprime"):
        raise ValueError(f"unknown alpha schedule {schedule!r}: expected one of {SCHEDULES}")
    if num_layers == 1:
        return (1.0,)
    stride = coprime_stride(num_layers) if schedule == "coprime" else 1
    slots = [(stride * layer) % num_layers for layer in range(num_layers)]
    return tuple(ALPHA_MIN + slot / (num_layers - 1) for slot in slots)


def alpha_to_logit(alpha: float, margin: float = LOGIT_MARGIN) -> float:
    """A learned layer's parameter: the logit with 0.5 + sigmoid(logit) = alpha, alpha first
    pulled into [0.5 + margin, 1.5 - margin] (the 0.55-1.45 span the paper reports for
    staggered-init runs).

    Args:
        alpha: The layer's alpha.
        margin: How far inside (0.5, 1.5) alpha is pulled first.

    Returns:
        The logit.
    """
    a = min(max(alpha, ALPHA_MIN + margin), ALPHA_MAX - margin) - ALPHA_MIN
    return math.log(a / (1.0 - a))


def logit_to_alpha(logit: float | jax.Array) -> float | jax.Array:
    """0.5 + sigmoid(logit): a float for a float, a JAX array for an array (traced or not).

    Args:
        logit: A Python float or a JAX array.

    Returns:
        alpha in (0.5, 1.5), of the same kind as ``logit``.
    """
    if isinstance(logit, int | float):
        return ALPHA_MIN + 1.0 / (1.0 + math.exp(-logit))
    import jax

    return ALPHA_MIN + jax.nn.sigmoid(logit)


def initial_alphas(acfg, num_layers: int) -> list[float] | None:
    """A learned model's starting alphas as it really starts them (the schedule pulled into
    [0.55, 1.45] by [alpha_to_logit][fibjax.attention.alpha_to_logit]); None for a model without learned alpha."""
    if not acfg.is_learned:
        return None
    return [logit_to_alpha(alpha_to_logit(a)) for a in acfg.layer_alphas(num_layers)]


def layer_alphas(params: dict, acfg, num_layers: int) -> list[float | None]:
    """Every layer's alpha in a parameter dict: learned layers from their logit, static offset
    layers from the schedule, None for layers without alpha (dense, block-sparse, NSA)."""
    if not acfg.has_alpha:
        return [None] * num_layers
    if not acfg.is_learned:
        return list(acfg.layer_alphas(num_layers))
    return [float(logit_to_alpha(params["blocks"][i]["attn"][PARAM])) for i in range(num_layers)]
