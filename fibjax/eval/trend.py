"""The length trend: does extrapolation get worse as the training length grows?

A ``Trend`` names the runs of one attention: its seeds, and the same recipe trained at other
lengths. Each run gives the perplexity change at m x its own training length over 1x (of the
geometric mean over the validation sets every run of the study scored); per training length, the
trend's point is the mean over its runs (seeds), drawn with their range. Paper A's dense RoPE
collapses at 4x its 1,024-token training length; at CPU size the change is far smaller, and this
is where the study shows whether it grows with the training length (``python -m launch.study
CONFIG --report``; the figure: ``fibjax.eval.plots.plot_length_trend``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# nll[dataset][length] of one run's plain evaluations (its own attention and RoPE)
NLLs = Mapping[str, Mapping[int, float]]


@dataclass(frozen=True)
class Trend:
    """One line of the figure: ``label`` and the study runs it averages (any training lengths)."""

    label: str
    runs: tuple[str, ...]


@dataclass(frozen=True)
class TrendPoint:
    trend: str
    train_len: int
    multiple: int
    runs: tuple[str, ...]
    changes: tuple[float, ...]  # per run: ``ppl_change``, percent

    @property
    def mean(self) -> float:
        return sum(self.changes) / len(self.changes)


def geometric_change(gaps: Sequence[float]) -> float:
    """100 (exp(mean gap) - 1): from NLL gaps (nats) over datasets, the percent change of their
    geometric-mean perplexity. The one average of this figure and of the report's curve during
    training (``plots.plot_long_curves``)."""
    return 100.0 * math.expm1(sum(gaps) / len(gaps))


def ppl_change(nll: NLLs, train_len: int, multiple: int, datasets: Sequence[str]) -> float | None:
    """``geometric_change`` of NLL(m L) - NLL(L) over ``datasets``; None if a dataset lacks either
    length."""
    gaps = []
    for d in datasets:
        at = nll.get(d, {})
        if train_len not in at or multiple * train_len not in at:
            return None
        gaps.append(at[multiple * train_len] - at[train_len])
    return geometric_change(gaps) if gaps else None


def points(trends: Sequence[Trend], runs: Mapping[str, tuple[int, NLLs]], datasets: Sequence[str], multiples: Sequence[int] = (2, 4)) -> list[TrendPoint]:
    """Every (trend, training length, multiple) that at least one finished run measured;
    ``runs``: name -> (training length, NLLs) of the finished runs."""
    out = []
    for trend in trends:
        by_len: dict[int, list[str]] = {}
        for name in trend.runs:
            if name in runs:
                by_len.setdefault(runs[name][0], []).append(name)
        for train_len in sorted(by_len):
            for m in multiples:
                measured = [(n, c) for n in by_len[train_len] if (c := ppl_change(runs[n][1], train_len, m, datasets)) is not None]
                if measured:
                    out.append(TrendPoint(trend.label, train_len, m, tuple(n for n, _ in measured), tuple(c for _, c in measured)))
    return out


def markdown(pts: Sequence[TrendPoint], datasets: Sequence[str]) -> str:
    lines = [
        f"Perplexity change at m x the training length over 1x (geometric mean over {', '.join(datasets)});"
        " per training length the mean over the runs (seeds), their range, and n.",
        "",
        "| attention | trained at | m | change, mean | range | n | runs |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for p in pts:
        span = f"{min(p.changes):+.1f} .. {max(p.changes):+.1f}" if len(p.changes) > 1 else ""
        lines.append(f"| {p.trend} | {p.train_len} | {p.multiple} | {p.mean:+.1f}% | {span} | {len(p.changes)} | {', '.join(p.runs)} |")
    return "\n".join(lines)


def write_csv(pts: Sequence[TrendPoint], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["attention", "train_len", "multiple", "run", "ppl_change_pct"])
        for p in pts:
            for name, c in zip(p.runs, p.changes):
                w.writerow([p.trend, p.train_len, p.multiple, name, f"{c:.4f}"])
    return path
