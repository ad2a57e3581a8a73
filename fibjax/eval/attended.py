"""A picture of paper A's attended set: per layer, the dense window and the rungs scaled by that
layer's alpha, for each alpha schedule side by side (``python -m launch.draw_attention``).

The distances come from the library's own functions (``attention.offsets``, ``attention.alpha``),
so the figure shows what the model attends, not a re-derivation of it. A learned layer reads
between two keys (``rung_taps``: lo and lo + 1, weighted by frac); its rungs are drawn at
``lo + frac``, the fractional distance its blend stands for.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from fibjax.attention import alpha as alpha_lib
from fibjax.attention import offsets
from fibjax.eval.plots import PALETTE, STYLE, _save


@dataclass(frozen=True)
class Panel:
    """One model: its name, rung base and one alpha per layer; ``learned``: interpolated rungs."""

    title: str
    base: offsets.Base
    alphas: tuple[float, ...]
    learned: bool = False


def rung_distances(panel: Panel, layer: int, *, window: int, seq_len: int) -> list[float]:
    """The rung distances beyond the window that ``layer`` attends (fractional for a learned layer)."""
    alpha = panel.alphas[layer]
    if panel.learned:
        return [lo + frac for _, lo, frac in offsets.rung_taps(window=window, base=panel.base, alpha=alpha, seq_len=seq_len)]
    return [d for d in offsets.attended_distances(window=window, base=panel.base, alpha=alpha, seq_len=seq_len) if d > window]


def learned_alphas(path: str | Path, run: str) -> tuple[float, ...]:
    """A run's trained alphas from a study's ``alpha.csv`` (columns run, layer, alpha)."""
    with open(path, newline="") as f:
        rows = sorted((int(r["layer"]), float(r["alpha"])) for r in csv.DictReader(f) if r["run"] == run)
    if not rows:
        raise ValueError(f"{path} has no alphas of run {run!r}")
    return tuple(a for _, a in rows)


def paper_panels(num_layers: int, learned: tuple[float, ...] | None) -> list[Panel]:
    """Paper A's schedules: fixed, staggered, coprime (Fibonacci), staggered powers of two, and a
    learned model's alphas after training (when given)."""
    panels = [
        Panel("fib fixed", "fibonacci", alpha_lib.alpha_schedule("fixed", num_layers)),
        Panel("fib stagger", "fibonacci", alpha_lib.alpha_schedule("staggered", num_layers)),
        Panel("fib coprime", "fibonacci", alpha_lib.alpha_schedule("coprime", num_layers)),
        Panel("pow2 stagger", "pow2", alpha_lib.alpha_schedule("staggered", num_layers)),
    ]
    if learned is not None:
        panels.append(Panel("fib learned, after training", "fibonacci", learned, learned=True))
    return panels


def plot_attended_distances(panels: list[Panel], path: Path, *, window: int, seq_len: int) -> bool:
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(3.0 * len(panels), 4.4), layout="constrained")
        axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
        for ax, panel in zip(axes, panels):
            for layer in range(len(panel.alphas)):
                ax.plot([0, window], [layer, layer], color=PALETTE[6], linewidth=5, solid_capstyle="butt")
                rungs = rung_distances(panel, layer, window=window, seq_len=seq_len)
                ax.plot(rungs, [layer] * len(rungs), "|", color=PALETTE[0], markersize=13, mew=2)
            ax.set_xscale("symlog", linthresh=window + 1, linscale=0.6)  # the window linear, the rungs logarithmic
            ax.set_xlim(0, seq_len)
            ax.set_xticks([0, window, 32, 128, seq_len - 1], ["0", str(window), "32", "128", str(seq_len - 1)])
            ax.set_title(f"{panel.title}\nalpha {min(panel.alphas):.2f}–{max(panel.alphas):.2f}", fontsize=10)
            ax.set_xlabel("distance (query - key)")
            ax.grid(axis="y", visible=False)
        axes[0].set_ylabel("layer (0 = first)")
        axes[0].set_yticks(range(len(panels[0].alphas)))
        axes[0].invert_yaxis()
        fig.suptitle(f"What each layer attends at T = {seq_len}: black, the window 0–{window}; blue ticks, the rungs (alpha x Fibonacci or power of two)")
        return _save(fig, path)
