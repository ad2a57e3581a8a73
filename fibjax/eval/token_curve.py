"""Against tokens seen: how a group of runs' extrapolation, and the gaps between them at the
training length, move as training goes on.

A ``TokenCurve`` names runs that log validation curves (``eval.curve_multipliers`` with 1 and
``multiple``) and differences between two of them ("stagger - dense"). For every validation point
a run logged, the report gives its mean NLL over the validation sources at 1x and at ``multiple``
x, and the perplexity change between the two (``trend.geometric_change``); for each difference
a - b, the gap of those means at both lengths, at the steps both runs logged. A run still training
is reported up to its last point, marked as such.

Read the steps, not the levels: the long curve scores the first ``eval.curve_long_tokens`` of each
source, the 1x curve the first ``eval.curve_tokens``; the run's final evaluation is the measurement
of where it ends (``extrap.csv``).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fibjax.config import ConfigError
from fibjax.eval.trend import geometric_change
from fibjax.run.curves import curve_values


@dataclass(frozen=True)
class Difference:
    """``a - b`` between two of a curve's runs, named ``label``."""

    label: str
    a: str
    b: str


@dataclass(frozen=True)
class TokenCurve:
    """Runs followed against tokens seen: ``name`` goes into the file names, ``title`` onto the
    figure; ``multiple``: the curve length beyond 1x that the change is read at."""

    name: str
    title: str
    runs: tuple[str, ...]
    differences: tuple[Difference, ...] = ()
    multiple: int = 4

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ConfigError(f"token curve name {self.name!r}: letters, digits and _ only (it names files)")
        if self.multiple < 2:
            raise ConfigError(f"token curve {self.name}: multiple must be >= 2, got {self.multiple}")
        for d in self.differences:
            missing = [n for n in (d.a, d.b) if n not in self.runs]
            if missing:
                raise ConfigError(f"token curve {self.name}: difference {d.label!r} names runs it does not follow: {missing}")


@dataclass(frozen=True)
class Point:
    """One validation point of one run (or one difference a - b): nats per token, mean over the
    validation sources logged at both lengths; ``change_pct`` only for a run."""

    series: str
    step: int
    tokens: int
    nll_1x: float
    nll_long: float | None
    change_pct: float | None = None


def run_points(name: str, rows: Sequence[Mapping], multiple: int) -> list[Point]:
    """A run's validation points, one per step (the last logged wins: a run resumed from a
    checkpoint logs the steps after it again)."""
    by_step = {}
    for row in rows:
        short = curve_values(row)
        if short and "tokens" in row:
            by_step[row["step"]] = row
    out = []
    for step in sorted(by_step):
        row = by_step[step]
        short, long = curve_values(row), curve_values(row, multiple)
        sources = sorted(s for s in long if s in short)
        if not sources:  # a run that logs 1x only: no long curve to read
            out.append(Point(name, step, row["tokens"], _mean(short.values()), None))
            continue
        gaps = [long[s] - short[s] for s in sources]
        out.append(Point(name, step, row["tokens"], _mean(short[s] for s in sources), _mean(long[s] for s in sources), geometric_change(gaps)))
    return out


def difference_points(d: Difference, a: Sequence[Point], b: Sequence[Point]) -> list[Point]:
    """a - b at the points both runs logged (the same tokens seen)."""
    b_at = {p.tokens: p for p in b}
    out = []
    for p in a:
        q = b_at.get(p.tokens)
        if q is None:
            continue
        long = p.nll_long - q.nll_long if p.nll_long is not None and q.nll_long is not None else None
        out.append(Point(d.label, p.step, p.tokens, p.nll_1x - q.nll_1x, long))
    return out


def points(curve: TokenCurve, metrics: Mapping[str, Sequence[Mapping]]) -> tuple[list[Point], list[Point]]:
    """(the runs' points, the differences' points) of ``curve``; ``metrics``: run name -> its
    metrics rows, for the runs that have any (a run not started is left out)."""
    runs = {n: run_points(n, metrics[n], curve.multiple) for n in curve.runs if n in metrics}
    diffs = [p for d in curve.differences if d.a in runs and d.b in runs for p in difference_points(d, runs[d.a], runs[d.b])]
    return [p for n in curve.runs if n in runs for p in runs[n]], diffs


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def write_csv(curve: TokenCurve, run_pts: Sequence[Point], diff_pts: Sequence[Point], states: Mapping[str, str], path: Path) -> Path:
    """One row per (series, step): a run's row has its state and change; a difference's, a - b."""
    m = curve.multiple
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["curve", "kind", "series", "state", "step", "tokens", "nll_1x", f"nll_{m}x", f"change_{m}x_pct"])
        for p in run_pts:
            w.writerow([curve.name, "run", p.series, states.get(p.series, ""), p.step, p.tokens, f"{p.nll_1x:.6f}", _f(p.nll_long, 6), _f(p.change_pct, 3)])
        for p in diff_pts:
            w.writerow([curve.name, "difference", p.series, "", p.step, p.tokens, f"{p.nll_1x:+.6f}", _f(p.nll_long, 6, "+"), ""])
    return path


def _f(x: float | None, digits: int, sign: str = "") -> str:
    return "" if x is None else f"{x:{sign}.{digits}f}"


def markdown(curve: TokenCurve, run_pts: Sequence[Point], diff_pts: Sequence[Point], states: Mapping[str, str]) -> str:
    """A row per point (tokens seen): each run's change at m x, each difference at 1x (nats)."""
    m = curve.multiple
    runs = list(dict.fromkeys(p.series for p in run_pts))
    diffs = list(dict.fromkeys(p.series for p in diff_pts))
    cell = {(p.series, p.tokens): p for p in (*run_pts, *diff_pts)}
    names = [f"{n}{'' if states.get(n, 'done') == 'done' else f' ({states[n]})'}" for n in runs]
    lines = [
        f"Per validation point: each run's perplexity change at {m}x over 1x (mean NLL over the validation "
        f"sources), and each difference a - b of the mean NLL at 1x, nats. The steps, not the levels, are "
        f"the measurement (the {m}x curve scores fewer tokens than 1x).",
        "",
        "| tokens | " + " | ".join(f"{n}, {m}x" for n in names) + "".join(f" | {d}, 1x" for d in diffs) + " |",
        "|---:|" + "---:|" * (len(runs) + len(diffs)),
    ]
    for tokens in sorted({p.tokens for p in (*run_pts, *diff_pts)}):
        row = [f"{tokens / 1e6:.2f}M"]
        row += [_f(p.change_pct, 1, "+") + "%" if (p := cell.get((n, tokens))) and p.change_pct is not None else "" for n in runs]
        row += [_f(p.nll_1x, 4, "+") if (p := cell.get((d, tokens))) else "" for d in diffs]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(curve: TokenCurve, run_pts: Sequence[Point], diff_pts: Sequence[Point], path: Path) -> Path | None:
    """Left: each run's change at m x against tokens; right: each difference at 1x (solid) and at
    m x (dashed) against tokens."""
    if not run_pts:
        return None
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # the object API, as plots.py: no pyplot state, no display

    m = curve.multiple
    fig = Figure(figsize=(11, 4.2) if diff_pts else (6, 4.2))
    axes = fig.subplots(1, 2 if diff_pts else 1, squeeze=False)[0]
    for ax in axes:
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.set_xlabel("training tokens (millions)")
    for i, name in enumerate(dict.fromkeys(p.series for p in run_pts)):
        pts = [p for p in run_pts if p.series == name and p.change_pct is not None]
        axes[0].plot([p.tokens / 1e6 for p in pts], [p.change_pct for p in pts], "o-", ms=3, color=colormaps["tab10"](i % 10), label=name)
    axes[0].set_ylabel(f"perplexity change, {m}x vs 1x (%)")
    axes[0].legend(fontsize=8, frameon=False)
    if diff_pts:
        for i, label in enumerate(dict.fromkeys(p.series for p in diff_pts)):
            pts = [p for p in diff_pts if p.series == label]
            color = colormaps["Dark2"](i % 8)
            axes[1].plot([p.tokens / 1e6 for p in pts], [p.nll_1x for p in pts], "o-", ms=3, color=color, label=f"{label}, 1x")
            longs = [p for p in pts if p.nll_long is not None]
            axes[1].plot([p.tokens / 1e6 for p in longs], [p.nll_long for p in longs], "s--", ms=3, color=color, label=f"{label}, {m}x")
        axes[1].set_ylabel("a - b, mean NLL (nats)")
        axes[1].legend(fontsize=8, frameon=False)
    fig.suptitle(f"Against tokens seen: {curve.title}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    return path
