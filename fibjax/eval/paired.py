"""Paired differences across seeds: is one model better than another beyond seed noise?

A study names comparisons ``a - b`` between two models (two config files). For every seed that
trained both, d_s = NLL(a, s) - NLL(b, s), per dataset and evaluation length, on the same scored
tokens (the difference of log perplexity, nats per token; negative: ``a`` is better). Over the
seeds: the mean, its standard error, a 95% interval and a two-sided paired t-test of mean d = 0
with n - 1 degrees of freedom. Within a seed both models share the initialisation seed and the data
order, so the seed's own luck cancels in d_s; that is what pairing buys over comparing means.

Writes ``paired.csv``, ``paired.png`` and a Markdown section for the study's report.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# nll_by_model[model][seed][dataset][length] -> mean NLL per token
NLLs = Mapping[str, Mapping[int, Mapping[str, Mapping[int, float]]]]


@dataclass(frozen=True)
class Comparison:
    """``a - b``: two models of a study, each named by its config file."""

    label: str  # e.g. "stagger - fixed (W8)"
    a: str
    b: str


@dataclass(frozen=True)
class PairedResult:
    comparison: str
    dataset: str
    length: int
    seeds: tuple[int, ...]
    diffs: tuple[float, ...]  # d_s in nats, one per seed

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return sum(self.diffs) / self.n

    @property
    def se(self) -> float | None:
        """Standard error of the mean; None with one seed."""
        if self.n < 2:
            return None
        var = sum((d - self.mean) ** 2 for d in self.diffs) / (self.n - 1)
        return math.sqrt(var / self.n)

    @property
    def t(self) -> float | None:
        se = self.se
        if se is None:
            return None
        return math.copysign(math.inf, self.mean) if se == 0 else self.mean / se

    @property
    def p(self) -> float | None:
        """Two-sided p-value of the paired t-test (n - 1 degrees of freedom); None with one seed."""
        from scipy import stats

        t = self.t
        return None if t is None else float(2 * stats.t.sf(abs(t), self.n - 1))

    @property
    def ci95(self) -> tuple[float, float] | None:
        from scipy import stats

        se = self.se
        if se is None:
            return None
        half = float(stats.t.ppf(0.975, self.n - 1)) * se
        return self.mean - half, self.mean + half


def paired(nlls: NLLs, comparisons: Sequence[Comparison]) -> list[PairedResult]:
    """Every (comparison, dataset, length) that at least one seed evaluated in both models."""
    results = []
    for c in comparisons:
        a, b = nlls.get(c.a, {}), nlls.get(c.b, {})
        seeds = sorted(set(a) & set(b))
        cells = sorted({(d, n) for s in seeds for d in a[s] for n in a[s][d] if n in b[s].get(d, {})})
        for dataset, length in cells:
            have = [s for s in seeds if length in a[s].get(dataset, {}) and length in b[s].get(dataset, {})]
            diffs = tuple(a[s][dataset][length] - b[s][dataset][length] for s in have)
            results.append(PairedResult(c.label, dataset, length, tuple(have), diffs))
    return results


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(results: Sequence[PairedResult], train_len: int) -> str:
    """The report's section: one row per comparison, dataset and length."""
    lines = [
        "d = NLL(a) - NLL(b) per seed on the same scored tokens (nats per token; < 0: a is better; "
        "the ppl ratio is exp(d)). Mean +- standard error, the 95% interval and a two-sided paired t-test "
        "(n - 1 degrees of freedom). Figure: paired.png; numbers: paired.csv.",
        "",
        "| comparison | dataset | length | n | d per seed (seed: nats) | mean +- SE | ppl change | 95% interval | t | p |",
        "|---|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in results:
        per_seed = ", ".join(f"{s}: {d:+.4f}" for s, d in zip(r.seeds, r.diffs))
        ci = r.ci95
        interval = "—" if ci is None else f"{ci[0]:+.4f} .. {ci[1]:+.4f}"
        lines.append(
            f"| {r.comparison} | {r.dataset} | {r.length} ({r.length // train_len}x) | {r.n} | {per_seed} "
            f"| {r.mean:+.4f} +- {_fmt(r.se, '.4f')} | {100 * math.expm1(r.mean):+.2f}% | {interval} | {_fmt(r.t, '.2f')} | {_fmt(r.p, '.3f')} |"
        )
    return "\n".join(lines)


def write_csv(results: Sequence[PairedResult], path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["comparison", "dataset", "length", "n", "seeds", "diffs_nats", "mean", "se", "ci95_lo", "ci95_hi", "t", "p"])
        for r in results:
            ci = r.ci95 or (None, None)
            w.writerow(
                [
                    r.comparison,
                    r.dataset,
                    r.length,
                    r.n,
                    " ".join(map(str, r.seeds)),
                    " ".join(f"{d:.6f}" for d in r.diffs),
                    r.mean,
                    r.se,
                    ci[0],
                    ci[1],
                    r.t,
                    r.p,
                ]
            )
    return path


def plot(results: Sequence[PairedResult], path: Path, train_len: int) -> Path | None:
    """One panel per (comparison, length): each seed's d per dataset, the mean and its 95% interval."""
    if not results:
        return None
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # the object API, as plots.py: no pyplot state, no display

    comparisons = list(dict.fromkeys(r.comparison for r in results))
    lengths = sorted({r.length for r in results})
    seeds = sorted({s for r in results for s in r.seeds})
    colors = {s: colormaps["tab10"](i % 10) for i, s in enumerate(seeds)}
    fig = Figure(figsize=(3.2 * len(lengths) + 1, 3.0 * len(comparisons) + 0.6))
    axes = fig.subplots(len(comparisons), len(lengths), squeeze=False, sharey="row")
    for i, comp in enumerate(comparisons):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            cell = [r for r in results if r.comparison == comp and r.length == length]
            ax.axhline(0.0, color="0.6", lw=0.8)
            for x, r in enumerate(cell):
                for s, d in zip(r.seeds, r.diffs):  # each seed at its own offset, the same in every panel
                    dx = -0.2 + 0.4 * seeds.index(s) / max(1, len(seeds) - 1)
                    ax.plot(x + dx - 0.1, d, "o", ms=4, color=colors[s], label=f"seed {s}" if x == 0 else None)
                ci = r.ci95
                if ci is not None:
                    ax.errorbar(x + 0.3, r.mean, yerr=[[r.mean - ci[0]], [ci[1] - r.mean]], fmt="s", color="k", ms=5, capsize=3)
                else:
                    ax.plot(x + 0.3, r.mean, "s", color="k", ms=5)
            ax.set_xticks(range(len(cell)), [r.dataset for r in cell], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{comp}, {length} ({length // train_len}x)", fontsize=9)
            if j == 0:
                ax.set_ylabel("d = NLL(a) - NLL(b), nats")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(seeds), fontsize=8, frameon=False)
    fig.suptitle("Paired differences per seed; black: mean and 95% interval (t, n - 1 df)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=110)
    return path
