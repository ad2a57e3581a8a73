"""Paper A's attended set: rungs and attended distances (alpha itself: ``alpha.py``).

Pure Python (no JAX), so every static pattern is known at trace time and can be checked
against the paper by hand. Semantics follow the paper's "normative" section and its public
reference code (see BUILD_NOTES.md, "Semantics"):

* the window is the distances {0, 1, ..., W} (self included, so no query is ever empty);
* a static rung lands at ``round(alpha * f)`` (Python ``round``: half to even) and is kept
  only if ``W < d <= T - 1``;
* the learned (interpolated) path keeps a fixed number of rung *slots* so that alpha can be
  a traced value; [rung_slots][fibjax.attention.rung_slots] says which rungs can ever be active.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fibjax.attention.alpha import ALPHA_MAX, ALPHA_MIN

FIBONACCI_RUNGS: tuple[int, ...] = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987)

Base = str | Sequence[int]


def base_rungs(base: Base, seq_len: int) -> tuple[int, ...]:
    """The rungs f_1..f_K of ``base`` for a model run at ``seq_len`` tokens.

    ``"fibonacci"``: the paper's 15 rungs up to 987 (independent of ``seq_len``).
    ``"pow2"``: reach-matched, every power of two <= seq_len - 1, so a longer evaluation
    length adds rungs that training never saw (the paper's control).
    A sequence of ints: used as given (positive integers).

    Args:
        base: ``"fibonacci"``, ``"pow2"`` or a sequence of positive ints.
        seq_len: The run's sequence length.

    Returns:
        The rungs.

    Raises:
        ValueError: ``seq_len < 1``, an unknown base name or a bad explicit base.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if isinstance(base, str):
        if base == "fibonacci":
            return FIBONACCI_RUNGS
        if base == "pow2":
            return tuple(1 << j for j in range(max(seq_len - 1, 1).bit_length()) if (1 << j) <= seq_len - 1)
        raise ValueError(f"unknown base {base!r}: expected 'fibonacci', 'pow2' or a sequence of ints")
    rungs = tuple(base)
    if not rungs or any(not isinstance(f, int) or isinstance(f, bool) or f < 1 for f in rungs):
        raise ValueError(f"an explicit base must be a non-empty sequence of positive ints, got {base!r}")
    return rungs


def bounded_base(base: Base, max_rung: int) -> Base:
    """``base`` keeping only rungs <= ``max_rung`` (0: no bound), as an explicit tuple.

    A bound scales the paper's geometry to a shorter training length: at T=1024 its largest
    Fibonacci rung (987) lies below T; a model trained at T=256 keeps that ratio with the rungs
    <= 255 (up to 233). The bound is part of the model, so evaluation at longer lengths keeps
    the trained list. pow2 is never bounded: it is reach-matched at the evaluated length by
    definition, which is what makes it the control.

    Args:
        base: ``"fibonacci"``, ``"pow2"`` or a sequence of positive ints.
        max_rung: The largest rung kept (0: no bound).

    Returns:
        ``base`` unchanged when ``max_rung`` is 0, else the kept rungs.

    Raises:
        ValueError: ``max_rung < 0``, a bound on pow2, or a bound that keeps no rung.
    """
    if max_rung < 0:
        raise ValueError(f"max_rung must be >= 0 (0 = no bound), got {max_rung}")
    if max_rung == 0:
        return base
    if isinstance(base, str) and base == "pow2":
        raise ValueError("max_rung does not apply to the pow2 base (reach-matched at the evaluated length by definition)")
    rungs = tuple(f for f in base_rungs(base, max_rung + 1) if f <= max_rung)
    if not rungs:
        raise ValueError(f"max_rung={max_rung} leaves no rung of {base!r}")
    return rungs


def attended_distances(*, window: int, base: Base, alpha: float, seq_len: int) -> tuple[int, ...]:  # noqa: DOC503
    """Sorted, unique distances of the static path: {0..W} U {round(alpha*f) : W < d <= T-1}.

    Args:
        window: W, the dense window {0..W}.
        base: ``"fibonacci"``, ``"pow2"`` or a sequence of positive ints.
        alpha: The rung scale.
        seq_len: T, the sequence length.

    Returns:
        The distances.

    Raises:
        ValueError: ``window < 0`` or a bad ``base``.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    rungs = base_rungs(base, seq_len)
    out = set(range(window + 1))
    for f in rungs:
        d = round(alpha * f)
        if window < d <= seq_len - 1:
            out.add(d)
    return tuple(sorted(out))


def rung_slots(*, window: int, base: Base, seq_len: int) -> tuple[int, ...]:
    """The rung slots of the learned path at ``seq_len``: the base rungs f that some alpha in
    [0.5, 1.5] can make active.

    The learned path gives each of these a slot and masks the inactive ones at run time; rungs
    outside this set can never be active (``round(1.5 f) <= W`` or ``floor(0.5 f) > T - 1``),
    so dropping them is exact and saves work.

    Args:
        window: W, the dense window {0..W}.
        base: ``"fibonacci"``, ``"pow2"`` or a sequence of positive ints.
        seq_len: T, the sequence length.

    Returns:
        The rungs that get a slot.
    """
    rungs = base_rungs(base, seq_len)
    return tuple(f for f in rungs if round(ALPHA_MAX * f) > window and math.floor(ALPHA_MIN * f) <= seq_len - 1)


def rung_taps(*, window: int, base: Base, alpha: float, seq_len: int) -> list[tuple[int, int, float]]:
    """The taps of an interpolated layer at ``alpha``, host-side: (rung f, lo, frac) of each
    active rung, in rung order (it reads keys i - lo and i - lo - 1, weights 1 - frac and frac),
    by the reference's rule.

    t = alpha*f, lo = floor(t), frac = t - lo; a rung is skipped if round(t) <= W, if lo > T-1,
    or if lo is already used (by the window {0..min(W, T-1)} or an earlier rung: first wins).
    The independent host-side statement of the rule; the traced
    version is ``offset_xla.traced_rung_taps``. Note the window counts as "used": a rung with
    round(t) > W but lo = W (t in [W+0.5, W+1)) is skipped, as in the reference code, though the
    static path at the same alpha would attend distance W+1 (BUILD_NOTES.md, "Semantics").

    Args:
        window: W, the dense window {0..W}.
        base: ``"fibonacci"``, ``"pow2"`` or a sequence of positive ints.
        alpha: The rung scale.
        seq_len: T, the sequence length.

    Returns:
        (f, lo, frac) per active rung.
    """
    used = set(range(min(window, seq_len - 1) + 1))
    spec = []
    for f in base_rungs(base, seq_len):
        t = alpha * f
        lo = math.floor(t)
        if round(t) <= window or lo > seq_len - 1 or lo in used:
            continue
        used.add(lo)
        spec.append((f, lo, t - lo))
    return spec
