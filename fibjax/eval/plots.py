"""The report's plots: perplexity vs length, NLL by position, alpha per layer, training loss, the
extrapolation curves during training and against the training length.

Every run keeps one colour and marker in every plot (Okabe-Ito, a colour-blind-safe palette;
markers tell lines apart in grey-scale too); a report of many runs draws its per-run line plots
per ``FigureGroup``, each group with its own styles. Figures are built with the object API
(``matplotlib.figure.Figure``), so nothing touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import io
import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullLocator, ScalarFormatter

from fibjax.eval.groups import FigureGroup, group_runs
from fibjax.eval.trend import geometric_change
from fibjax.run.curves import curve_key, curve_values, multipliers

# Okabe & Ito (2008), yellow last: it is hard to see on white.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.")
STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "figure.titlesize": 14,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.dpi": 150,
}
GUIDE = "#666666"  # reference lines (training length, zero gap)
# A linear perplexity axis spans at least this fraction of its values' midpoint: without a floor,
# matplotlib stretches a +0.5% change across the whole panel and it reads as a steep climb.
MIN_PPL_SPAN = 0.1
MAX_COLUMNS = 3  # panels per row; more datasets wrap


@dataclass(frozen=True)
class RunStyle:
    color: str
    marker: str
    linestyle: str


def run_styles(labels: list[str]) -> dict[str, RunStyle]:
    """A fixed style per run, in the order given (runs beyond 8 change line style and marker:
    the 9th run is not the 1st with dashes alone)."""
    n = len(PALETTE)
    return {label: RunStyle(PALETTE[i % n], MARKERS[(i + i // n) % n], LINESTYLES[(i // n) % len(LINESTYLES)]) for i, label in enumerate(labels)}


def _line_plots(runs, datasets: list[str], reference, styles, suffix: str = "", title: str = ""):
    """(title, file name, draw) of the plots that draw one line per run."""
    tail = f": {title}" if title else ""
    return (
        (f"Perplexity vs evaluation length{tail}", f"ppl_vs_length{suffix}.png", lambda p: plot_ppl_vs_length(runs, datasets, p, styles, title)),
        (f"NLL by position in the window{tail}", f"posloss{suffix}.png", lambda p: plot_posloss(runs, datasets, p, styles, reference, title)),
    )


def plot_all(runs, datasets: list[str], out: Path, *, reference=None, groups: tuple[FigureGroup, ...] = ()) -> list[tuple[str, Path]]:
    """Every plot that the runs have data for: (title, path) in report order. With ``groups``,
    perplexity vs length and NLL by position are drawn once per group (``*_NAME.png``, styles
    per group) instead of once over every run."""
    styles = run_styles([r.label for r in runs])
    if groups:
        lines = []
        for g in groups:
            members = group_runs(runs, g)
            if members:
                ref = next((r for r in members if r.report["run"] == g.reference), None)
                drawn = run_styles([r.label for r, _ in _lengths_joined(members)])  # one style per line
                lines += _line_plots(members, datasets, ref, drawn, f"_{g.name}", g.title)
    else:
        lines = _line_plots(runs, datasets, reference, styles)
    made = []
    with matplotlib.rc_context(STYLE):
        for title, name, fn in (
            *lines,
            ("Alpha per layer", "alpha.png", lambda p: plot_alpha(runs, p, styles)),
            ("Training (and validation) loss", "loss.png", lambda p: plot_loss(runs, p, styles, reference)),
            ("Validation loss during training", "val_loss.png", lambda p: plot_val_curves(runs, p, styles)),
            ("Extrapolation during training", "long_curve.png", lambda p: plot_long_curves(runs, p)),
            ("Attention error vs dropped mass", "error_law.png", lambda p: plot_error_law(runs, p)),
        ):
            if fn(out / name):
                made.append((title, out / name))
    return made


def _panels(n: int, *, rows: int = 1, width: float = 6.0, height: float = 4.2) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width * n, height * rows + 0.6), layout="constrained")
    return fig, np.atleast_2d(fig.subplots(rows, n, squeeze=False))


def _dataset_panels(n: int) -> tuple[Figure, np.ndarray]:
    """One panel per dataset, at most MAX_COLUMNS a row; the unused panels of the last row hidden."""
    cols = min(n, MAX_COLUMNS)
    fig, axes = _panels(cols, rows=math.ceil(n / cols), width=5.5 if cols > 1 else 6.5)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


def _finish_panels(fig: Figure, axes, ylabel: str, title: str, path: Path) -> bool:
    """The y label on each row's first panel, the title, the shared legend, and the PNG."""
    for row in axes:
        row[0].set_ylabel(ylabel)
    fig.suptitle(title)
    _legend(fig, axes)
    return _save(fig, path)


def _legend(fig: Figure, axes) -> None:
    """One legend for the figure, under the panels, from the first panel's labelled lines."""
    handles, labels = {}, {}
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
            labels.setdefault(lab, lab)
    if not handles:
        return
    # as many columns (up to 4) as fit the figure's width: a centred legend wider than the figure
    # loses its first handles and last labels off the two edges
    renderer = FigureCanvasAgg(fig).get_renderer()
    for ncols in range(min(4, len(handles)), 0, -1):
        legend = fig.legend(list(handles.values()), list(labels), loc="outside lower center", ncols=ncols, frameon=False)
        if ncols == 1 or legend.get_window_extent(renderer).width <= 0.98 * fig.bbox.width:
            return
        legend.remove()


def _log_y(ax) -> None:
    """Log y axis with plain-number ticks at 1, 1.5, 2, 3, 5, 7 x 10^k: dense enough that every
    curve has a labelled tick near it, even over less than a decade."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())


def _span_at_least(ax, lo: float, hi: float, fraction: float) -> None:
    """A y axis around [lo, hi] at least ``fraction`` of their midpoint tall (centred on them)."""
    mid, half = (lo + hi) / 2, max(hi - lo, fraction * (lo + hi) / 2) / 2
    margin = 0.05 * 2 * half  # matplotlib's usual 5% padding
    ax.set_ylim(mid - half - margin, mid + half + margin)


def fit_titles(fig: Figure, *, rounds: int = 3) -> None:
    """Wrap every title (the figure's and each panel's) that runs past the figure's edges, or
    past its panel's width into the next panel's title. Constrained layout makes room for a
    title's height but not its width: a long one is cut, or overlaps its neighbour."""
    FigureCanvasAgg(fig)  # a renderer to measure text with
    for _ in range(rounds):
        fig.draw_without_rendering()
        width, clipped = fig.bbox.width, []
        titles = [(text, None) for text in fig.texts] + [(ax.title, ax) for ax in fig.axes if ax.get_visible()]
        for text, ax in titles:
            if not text.get_text() or text.get_horizontalalignment() != "center":
                continue
            box = text.get_window_extent()
            centre = (box.x0 + box.x1) / 2
            room = 0.97 * 2 * min(centre, width - centre)  # centred text: twice the distance to the nearer edge
            if ax is not None:
                room = min(room, 1.05 * ax.bbox.width)
            if box.width > room:
                clipped.append((text, room / box.width))
        if not clipped:
            return
        for text, shrink in clipped:
            lines = text.get_text().split("\n")
            fit = max(12, int(max(map(len, lines)) * shrink))
            text.set_text("\n".join(wrap_phrases(line, fit) for line in lines))


def wrap_phrases(line: str, width: int) -> str:
    """``line`` in lines of at most ``width`` characters, broken after a phrase (``, `` ``: ``
    ``; `` or before `` (``) where one fits, so that "trained at 256" never splits as "trained
    at" / "256"; a phrase longer than ``width`` alone is broken at spaces."""
    phrases = re.findall(r".+?(?:[,:;] |(?= \()|$)", line)
    out, current = [], ""
    for phrase in phrases:
        if current and len(current + phrase.rstrip()) > width:
            out.append(current.rstrip())
            current = phrase.lstrip()
        else:
            current += phrase
    out.append(current.rstrip())
    return "\n".join(textwrap.fill(part, width) if len(part) > width else part for part in out if part)


def _save(fig: Figure, path: Path) -> bool:
    """A PNG with an adaptive 256-colour palette: line plots look the same at a third of the bytes."""
    from PIL import Image

    fit_titles(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    image = Image.open(buffer).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    return True


# an evaluation's settings, less what depends on the lengths it scored
_LENGTH_KEYS = ("lengths", "datasets", "new_distances")


def _lengths_joined(runs) -> list[tuple[object, dict[str, list[dict]]]]:
    """(run, its rows per dataset by length): evaluations of one checkpoint that differ only in
    their lengths (a study's extra ``--lengths`` evaluation) are one line, under the first one's
    label; any other difference (inference mode, RoPE scaling, token count) keeps its own line."""
    joined: dict[tuple, tuple[object, dict]] = {}
    for r in runs:
        settings = json.dumps({k: v for k, v in r.report.items() if k not in _LENGTH_KEYS}, sort_keys=True, default=str)
        _, rows = joined.setdefault((str(r.workdir), settings), (r, {}))
        for d in r.report["datasets"]:
            have = {row["length"] for row in rows.get(d, [])}
            rows.setdefault(d, []).extend(row for row in r.rows(d) if row["length"] not in have)
    return [(r, {d: sorted(v, key=lambda row: row["length"]) for d, v in rows.items()}) for r, rows in joined.values()]


def plot_ppl_vs_length(runs, datasets: list[str], path: Path, styles: dict[str, RunStyle], title: str = "") -> bool:
    fig, axes = _dataset_panels(len(datasets))
    train_lens = {r.train_len for r in runs}
    lines = _lengths_joined(runs)
    for ax, d in zip(axes.flat, datasets):
        lengths, ppls = set(), []
        for r, rows_by_dataset in lines:
            rows = rows_by_dataset.get(d, [])
            if not rows:
                continue
            s = styles[r.label]
            x = [row["length"] for row in rows]
            y = [row["ppl"] for row in rows]
            ax.plot(x, y, color=s.color, marker=s.marker, linestyle=s.linestyle, linewidth=2, markersize=7, label=r.label)
            lengths.update(x)
            ppls += y
        ticks = sorted(lengths | train_lens)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t}\n(trained)" if t in train_lens else str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        log = bool(ppls) and max(ppls) / min(ppls) > 3
        if log:
            _log_y(ax)
        elif ppls:
            _span_at_least(ax, min(ppls), max(ppls), MIN_PPL_SPAN)
        for t in train_lens:
            ax.axvline(t, color=GUIDE, linestyle=":", linewidth=1.2, zorder=0)
        ax.set_xlim(ticks[0] / 1.25, ticks[-1] * 1.25)
        ax.set_title(f"{d} (perplexity on a log scale)" if log else d)  # the y label is on the first panel only
        ax.set_xlabel("evaluation length (tokens, log scale)")
    return _finish_panels(fig, axes, "perplexity (lower is better)", "Perplexity vs evaluation length" + (f": {title}" if title else ""), path)


def _bin_ticks(runs, nbins: int) -> tuple[list[str], str]:
    """Tick labels: the token positions of each bin when every run shares its training length."""
    lens = {r.train_len for r in runs}
    if len(lens) != 1:
        return [str(i + 1) for i in range(nbins)], "position bin (1 = start of the window)"
    starts = [math.ceil(i * next(iter(lens)) / nbins) for i in range(nbins)]
    return [str(x) for x in starts], "token position in the window (first position of each bin)"


def plot_posloss(runs, datasets: list[str], path: Path, styles: dict[str, RunStyle], reference=None, title: str = "") -> bool:
    has = [d for d in datasets if any(r.at_train_len(d) for r in runs)]
    if not has:
        return False
    fig, axes = _panels(len(has), rows=2 if reference else 1, height=3.8)
    nbins = max(len(r.at_train_len(d)["bin_nll"]) for d in has for r in runs if r.at_train_len(d))
    ticks, xlabel = _bin_ticks(runs, nbins)
    for j, d in enumerate(has):
        ref_row = reference.at_train_len(d) if reference else None
        for r, _ in _lengths_joined(runs):  # an evaluation at more lengths scores the same windows
            row = r.at_train_len(d)
            if row is None:
                continue
            s = styles[r.label]
            x = np.arange(1, len(row["bin_nll"]) + 1)
            kw = {"color": s.color, "marker": s.marker, "linestyle": s.linestyle, "linewidth": 2, "markersize": 6, "label": r.label}
            axes[0][j].plot(x, row["bin_nll"], **kw)
            if ref_row is not None and r is not reference and r.train_len == reference.train_len and len(row["bin_nll"]) == len(ref_row["bin_nll"]):
                axes[1][j].plot(x, np.subtract(row["bin_nll"], ref_row["bin_nll"]), **kw)
        axes[0][j].set_title(d)
        axes[0][0].set_ylabel("NLL (nats per token)")
        if reference:
            gap_ax = axes[1][j]
            gap_ax.axhline(0, color=GUIDE, linewidth=1.2, zorder=0)
            gap_ax.set_title(f"{d}: minus {reference.label} (> 0: worse)", fontsize=11)
            axes[1][0].set_ylabel("NLL gap (nats per token)")
        for ax in axes[:, j]:
            ax.set_xticks(np.arange(1, nbins + 1), ticks)
        axes[-1][j].set_xlabel(xlabel)
    lens = sorted({r.train_len for r in runs})
    fig.suptitle((f"{title}: " if title else "") + f"NLL by position, windows of the training length ({', '.join(map(str, lens))} tokens)")
    _legend(fig, axes)
    return _save(fig, path)


def _same_alphas(runs) -> list[tuple[object, list[float] | None, int]]:
    """(run, its initial alphas if learned, how many more runs share its alphas): runs without a
    learned start (fixed schedules, every seed alike) that end with equal alphas are drawn once,
    labelled "RUN (+k alike)"."""
    groups: dict = {}
    for r in runs:
        init = r.initial_alphas()
        key = (tuple(r.report["alphas"]), r.label) if init else (tuple(r.report["alphas"]),)
        groups.setdefault(key, []).append((r, init))
    return [(*rs[0], len(rs) - 1) for rs in groups.values()]


def plot_alpha(runs, path: Path, styles: dict[str, RunStyle]) -> bool:
    runs = _one_per_workdir(runs)  # evaluation variants of one run share its alphas
    with_alpha = [r for r in runs if any(a is not None for a in r.report["alphas"])]
    if not with_alpha:
        return False
    lines = _same_alphas(with_alpha)
    fig, axes = _panels(1, width=9.0)
    ax = axes[0][0]
    ax.axhspan(0.5, 1.5, color="#000000", alpha=0.04, zorder=0)
    for i, (r, init, more) in enumerate(lines):
        s = styles[r.label]
        alphas = r.report["alphas"]
        layers = np.arange(len(alphas)) + 0.08 * (i - (len(lines) - 1) / 2)  # dodge: equal schedules stay visible
        label = r.label + (f" (+{more} alike)" if more else "")
        ax.plot(layers, alphas, color=s.color, marker=s.marker, linestyle=s.linestyle, linewidth=2, markersize=7, label=label)
        if init:
            ax.plot(
                layers, init, color=s.color, marker=s.marker, linestyle="--", linewidth=1.2, markersize=7, markerfacecolor="white", label=f"{r.label} (init)"
            )
    n = max(len(r.report["alphas"]) for r in with_alpha)
    ax.set_xticks(range(n))
    ax.set_ylim(0.42, 1.58)
    ax.set_xlabel("layer (0 = first)")
    ax.set_ylabel("alpha (rung scale)")
    note = "shaded: the allowed range 0.5–1.5" + ("; open markers: a learned run's initial value" if any(init for _, init, _ in lines) else "")
    no_alpha = [r.label for r in runs if r not in with_alpha]
    if no_alpha:
        names = ", ".join(no_alpha) if len(no_alpha) <= 3 else f"{len(no_alpha)} runs"
        note += f"\nnot shown (dense attention, no alpha): {names}"
    ax.set_title(note, fontsize=10)
    fig.suptitle("Alpha per layer")
    _legend(fig, axes)
    return _save(fig, path)


def smooth(values, window: int, *, min_points: int = 1) -> np.ndarray:
    """Centred moving average (no lag). Near the ends, where the window is cut by the array's
    bounds, a straight line fitted over the points that remain is evaluated instead: a straight
    line stays straight, and the last point is still an average over half a window, so the
    curve does not jump to the raw value at the last step. Points with fewer than
    ``min_points`` values in their window are NaN."""
    v = np.asarray(values, dtype=float)
    n = len(v)
    i = np.arange(n)
    half = window // 2
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half + 1, n)

    def window_sum(a):
        c = np.concatenate([[0.0], np.cumsum(a)])
        return c[hi] - c[lo]

    x = i - i.mean()  # centred, for a well-conditioned fit
    s0, sx, sxx, sy, sxy = hi - lo, window_sum(x), window_sum(x * x), window_sum(v), window_sum(x * v)
    denom = s0 * sxx - sx * sx
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(denom > 0, (s0 * sxy - sx * sy) / np.where(denom > 0, denom, 1), 0.0)
    out = (sy - slope * sx) / s0 + slope * x
    return np.where(s0 >= min_points, out, np.nan)


def _loss_curve(run, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [m for m in run.metrics if "loss" in m and "step" in m]
    # the cross-entropy: an SSA run's "loss" also holds its weighted alignment term
    loss = np.array([m.get("ce", m["loss"]) for m in rows])
    return np.array([m["step"] for m in rows]), loss, smooth(loss, window)


def _val_curve(run) -> tuple[np.ndarray, np.ndarray]:
    """The validation curve logged during training (``eval.every_steps``): the mean NLL over the
    run's validation sources at each step it was measured (empty arrays when none was)."""
    rows = [list(curve_values(m).values()) for m in run.metrics]
    points = [(m["step"], float(np.mean(v))) for m, v in zip(run.metrics, rows, strict=True) if v]
    return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def _one_per_workdir(runs) -> list:
    """The first run of each run directory: evaluation variants of one run share its training."""
    seen, out = set(), []
    for r in runs:
        if r.workdir not in seen:
            seen.add(r.workdir)
            out.append(r)
    return out


def plot_loss(runs, path: Path, styles: dict[str, RunStyle], reference=None) -> bool:
    with_metrics = [r for r in _one_per_workdir(runs) if any("loss" in m for m in r.metrics)]
    if reference is not None and reference not in with_metrics:
        reference = next((r for r in with_metrics if r.workdir == reference.workdir), None)
    if not with_metrics:
        return False
    gap = reference in with_metrics and len(with_metrics) > 1
    fig, axes = _panels(2 if gap else 1, width=6.5 if gap else 7.5)
    window = max(5, max(sum("loss" in m for m in r.metrics) for r in with_metrics) // 20) | 1
    curves = {r.label: _loss_curve(r, window) for r in with_metrics}
    val_curves = {r.label: _val_curve(r) for r in with_metrics}
    with_val = any(len(v[0]) for v in val_curves.values())
    ax = axes[0][0]
    for r in with_metrics:
        s, (steps, loss, smoothed), (val_steps, val) = styles[r.label], curves[r.label], val_curves[r.label]
        ax.plot(steps, loss, color=s.color, linewidth=0.8, alpha=0.25)
        ax.plot(steps, smoothed, color=s.color, linestyle=s.linestyle, linewidth=2, label=r.label)
        if len(val):  # unlabelled: the legend names runs; the subtitle says what the dashed lines are
            ax.plot(val_steps, val, color=s.color, linestyle="--", marker=s.marker, markerfacecolor="white", linewidth=1.6, markersize=6)
    all_loss = np.concatenate([c[1] for c in curves.values()] + [v[1] for v in val_curves.values()])
    log = all_loss.min() > 0 and all_loss.max() / all_loss.min() > 1.5
    if log:
        _log_y(ax)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (nats per token, log scale)" if log else "loss (nats per token)")
    note = "\ndashed, open markers: validation NLL (mean over the run's validation sets)" if with_val else ""
    ax.set_title(f"faint: training loss, every step; bold: centred mean over {window} steps{note}", fontsize=10)
    if gap:
        ref_steps, ref_loss, _ = curves[reference.label]
        gap_window = max(window, len(ref_steps) // 8) | 1  # the same batches: per-step differences, smoothed more
        gap_ax = axes[0][1]
        gap_ax.axhline(0, color=GUIDE, linewidth=1.2, zorder=0)
        for r in with_metrics:
            if r is reference:
                continue
            s, (steps, loss, _) = styles[r.label], curves[r.label]
            common, i, j = np.intersect1d(steps, ref_steps, return_indices=True)
            gap = smooth(loss[i] - ref_loss[j], gap_window, min_points=gap_window // 2)
            gap_ax.plot(common, gap, color=s.color, linestyle=s.linestyle, linewidth=2, label=r.label)
        gap_ax.set_xlabel("training step")
        gap_ax.set_ylabel("loss gap (nats per token)")
        gap_ax.set_title(f"loss minus {reference.label}'s at the same step (> 0: worse)\ncentred mean over {gap_window} steps", fontsize=10)
    fig.suptitle("Training and validation loss" if with_val else "Training loss")
    _legend(fig, axes)
    return _save(fig, path)


def plot_val_curves(runs, path: Path, styles: dict[str, RunStyle]) -> bool:
    """The validation curves logged during training (``eval.every_steps``), a panel per dataset."""
    runs = _one_per_workdir(runs)
    names = sorted({name for r in runs for m in r.metrics for name in curve_values(m)})
    if not names:
        return False
    fig, axes = _dataset_panels(len(names))
    for ax, name in zip(axes.flat, names):
        for r in runs:
            rows = [m for m in r.metrics if curve_key(1, name) in m]
            if rows:
                s = styles[r.label]
                ax.plot(
                    [m["step"] for m in rows],
                    [m[curve_key(1, name)] for m in rows],
                    color=s.color,
                    marker=s.marker,
                    linestyle=s.linestyle,
                    linewidth=2,
                    markersize=5,
                    label=r.label,
                )
        ax.set_title(name)
        ax.set_xlabel("training step")
    return _finish_panels(fig, axes, "validation NLL at the training length", "Validation loss during training", path)


def _long_curve(run, multiplier: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens seen, % change of perplexity at ``multiplier`` x the training length against 1x),
    the NLLs averaged over the validation sources logged at both lengths."""
    points = []
    for m in run.metrics:
        short, long = curve_values(m), curve_values(m, multiplier)
        if sources := [s for s in long if s in short]:
            if "tokens" in m:
                points.append((m["tokens"], geometric_change([long[s] - short[s] for s in sources])))
    return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def plot_long_curves(runs, path: Path) -> bool:
    """The validation curve beyond the training length (``eval.curve_multipliers``): how much
    worse the perplexity is at m x the training length than at 1x, against tokens seen."""
    runs = _one_per_workdir(runs)
    mults = multipliers([m for r in runs for m in r.metrics])
    if not mults:
        return False
    curves = {(r.label, m): _long_curve(r, m) for r in runs for m in mults}
    # a style per run drawn (a handful of a study's dozens): with the study-wide styles, runs 8
    # apart share colour and marker and two dense curves read as one
    styles = run_styles([r.label for r in runs if any(len(curves[r.label, m][0]) for m in mults)])
    fig, axes = _dataset_panels(len(mults))
    for ax, mult in zip(axes.flat, mults):
        ax.axhline(0, color=GUIDE, linewidth=1.2, zorder=0)
        for r in runs:
            tokens, change = curves[r.label, mult]
            if len(tokens):
                s = styles[r.label]
                ax.plot(tokens / 1e6, change, color=s.color, marker=s.marker, linestyle=s.linestyle, linewidth=2, markersize=5, label=r.label)
        ax.set_title(f"{mult}x the training length")
        ax.set_xlabel("training tokens (millions)")
    return _finish_panels(fig, axes, "perplexity change vs 1x (%)", "Extrapolation during training (mean over validation sets)", path)


def plot_length_trend(pts, path: Path) -> bool:
    """A panel per multiple: the change against the training length (log 2), a line per trend,
    each point the mean over seeds with a bar over their range (``fibjax.eval.trend.points``)."""
    if not pts:
        return False
    multiples = sorted({p.multiple for p in pts})
    labels = list(dict.fromkeys(p.trend for p in pts))
    styles = run_styles(labels)
    lengths = sorted({p.train_len for p in pts})
    with matplotlib.rc_context(STYLE):
        fig, axes = _dataset_panels(len(multiples))
        for ax, m in zip(axes.flat, multiples):
            ax.axhline(0, color=GUIDE, linewidth=1.2, zorder=0)
            for label in labels:
                line = sorted((p for p in pts if p.trend == label and p.multiple == m), key=lambda p: p.train_len)
                if not line:
                    continue
                s = styles[label]
                x = [p.train_len for p in line]
                y = [p.mean for p in line]
                err = [[p.mean - min(p.changes) for p in line], [max(p.changes) - p.mean for p in line]]
                ax.errorbar(x, y, yerr=err, color=s.color, marker=s.marker, linestyle=s.linestyle, linewidth=2, markersize=7, capsize=4, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(t) for t in lengths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlim(lengths[0] / 1.4, lengths[-1] * 1.4)
            ax.set_title(f"at {m}x the training length")
            ax.set_xlabel("training length (tokens, log scale)")
        return _finish_panels(fig, axes, "perplexity change vs 1x (%)", "Extrapolation against the training length (mean over seeds; bars: their range)", path)


def plot_error_law(runs, path: Path) -> bool:
    """Paper B's law: per run (one panel each), ||o - o_dense|| against the dropped mass of
    sampled queries of every layer, at the first dataset's training length, with the fitted line."""
    from fibjax.eval.error_law import plotted  # (error_law imports JAX: only this plot needs it)

    panels = []
    for r in runs:
        where = plotted(r.report)
        layers = r.report["error_law"][where[0]][where[1]] if where else None
        if layers:
            panels.append((r, layers))
    if not panels:
        return False
    styles = run_styles([r.label for r, _ in panels])  # the runs drawn, not the study's dozens (no yellow for three)
    fig, axes = _dataset_panels(len(panels))
    for ax, (r, layers) in zip(axes.flat, panels):
        mass = np.concatenate([x["points"]["mass"] for x in layers])
        error = np.concatenate([x["points"]["error"] for x in layers])
        ax.scatter(mass, error, s=6, alpha=0.35, color=styles[r.label].color, label=r.label)
        slope = float(np.mean([x["slope"] for x in layers]))
        top = float(mass.max()) if mass.size else 1.0
        ax.plot([0, top], [0, slope * top], color=GUIDE, linestyle="--", linewidth=1.2, label="fit (mean slope)")
        ax.set_title(f"{r.label}\nslope {slope:.2f}, min R$^2$ {min(x['r2'] for x in layers):.2f}")
        ax.set_xlabel("dropped mass")
    return _finish_panels(fig, axes, "||o - o_dense||", "Attention error vs dropped mass, every layer (paper B)", path)
