"""Which distances each layer attends, which alphas put a rung on a distance, and the band
centres that make the reward for moving alpha explicit. Pure Python over ``attended_distances``.

A *band candidate* is a centre c whose band (c - w//2 .. c + w//2) holds no distance attended at
alpha = 1, while some alpha in [0.5, 1.5] puts a rung exactly on c: a learned layer can reach the
band only by moving its alpha there.
"""

from __future__ import annotations

import math

from fibjax import kinds
from fibjax.attention import alpha as alpha_lib
from fibjax.attention import offsets
from fibjax.config import AttentionConfig
from fibjax.probe.tasks import Band, ProbeError


def layer_distances(attention: AttentionConfig, num_layers: int, seq_len: int, alphas=None) -> list[tuple[int, ...]]:
    """Per layer, the sorted distances it attends at ``seq_len`` (offsets: the static rule
    round(alpha f), also for a learned layer at its current alpha). ``alphas`` replaces the
    schedule (a learned model's current values); dense: every distance."""
    kind = kinds.kind_of(attention)
    if not attention.has_alpha:
        alphas = [None] * num_layers
    elif alphas is None:
        alphas = attention.layer_alphas(num_layers)
    sets = [kind.attended(attention, None if a is None else float(a), seq_len) for a in alphas]
    if any(s is None for s in sets):
        raise ProbeError(f"no fixed distance set for attention kind {attention.kind!r} (its keys are chosen by content)")
    return sets


def stack_reach(sets: list[tuple[int, ...]], seq_len: int) -> set[int]:
    """Distances a stack can relay a token over: one distance per layer (0 included), summed."""
    reach = {0}
    for s in sets:
        reach = {a + b for a in reach for b in s if a + b <= seq_len - 1}
    return reach


def alphas_for(distance: int, *, window: int, base, seq_len: int) -> list[tuple[int, float, float]]:
    """(rung f, alpha_lo, alpha_hi): the open alpha intervals inside [0.5, 1.5] on which
    round(alpha * f) == ``distance`` (a static rung lands on it; a learned rung reads it as its
    nearer key). Empty when ``distance`` is inside the window or past the sequence."""
    if not window < distance <= seq_len - 1:
        return []
    out = []
    for f in offsets.base_rungs(base, seq_len):
        lo, hi = max((distance - 0.5) / f, alpha_lib.ALPHA_MIN), min((distance + 0.5) / f, alpha_lib.ALPHA_MAX)
        if lo < hi:
            out.append((f, lo, hi))
    return out


def nearest_alpha(distance: int, alpha: float, *, window: int, base, seq_len: int) -> float | None:
    """The alpha closest to ``alpha`` that puts some rung exactly on ``distance`` (d / f)."""
    targets = [min(max(distance / f, lo), hi) for f, lo, hi in alphas_for(distance, window=window, base=base, seq_len=seq_len)]
    return min(targets, key=lambda a: abs(a - alpha)) if targets else None


def band_candidates(*, window: int, base, seq_len: int, width: int, max_distance: int) -> list[int]:
    """Centres c <= max_distance whose band no rung covers at alpha = 1 and on which some alpha
    in [0.5, 1.5] puts a rung."""
    at_one = set(offsets.attended_distances(window=window, base=base, alpha=1.0, seq_len=seq_len))
    out = []
    for c in range(window + 1, max_distance + 1):
        band = Band.around(c, width)
        if band.lo > window and not at_one & set(band.distances()) and alphas_for(c, window=window, base=base, seq_len=seq_len):
            out.append(c)
    return out


def gap_centres(*, window: int, base, seq_len: int, width: int, max_distance: int) -> list[int]:
    """One candidate per gap between consecutive alpha = 1 distances: the candidate nearest the
    gap's midpoint (the farthest a rung has to travel), in increasing order."""
    at_one = [d for d in offsets.attended_distances(window=window, base=base, alpha=1.0, seq_len=seq_len) if d >= window] + [seq_len - 1]
    cands = band_candidates(window=window, base=base, seq_len=seq_len, width=width, max_distance=max_distance)
    out = []
    for a, b in zip(at_one, at_one[1:]):
        inside = [c for c in cands if a < c < b]
        if inside:
            out.append(min(inside, key=lambda c: (abs(c - (a + b) / 2), c)))
    return out


def distance_table(band: Band, attention: AttentionConfig, num_layers: int, seq_len: int, alphas=None) -> list[dict]:
    """Per layer: its alpha, the rung distance nearest the band's centre, how far that is from the
    band, and the alpha (nearest the layer's) that would put a rung on the centre."""
    alphas = list(attention.layer_alphas(num_layers) if alphas is None else alphas)
    rows = []
    for layer, (a, ds) in enumerate(zip(alphas, layer_distances(attention, num_layers, seq_len, alphas))):
        nearest = min(ds, key=lambda d: (abs(d - band.centre), d))
        gap = 0 if band.lo <= nearest <= band.hi else min(abs(nearest - band.lo), abs(nearest - band.hi))
        needed = nearest_alpha(band.centre, a, window=attention.window, base=attention.bounded_base, seq_len=seq_len)
        rows.append(
            {"layer": layer, "alpha": float(a), "nearest_distance": nearest, "distance_to_band": gap, "alpha_for_centre": needed, "covers_band": gap == 0}
        )
    return rows


def theta_distance(alpha_from: float, alpha_to: float) -> float:
    """|logit_to - logit_from| with alpha = 0.5 + sigmoid(logit): how far the alpha parameter must move."""
    logit = lambda a: math.log((a - 0.5) / (1.5 - a))
    return abs(logit(alpha_to) - logit(alpha_from))
