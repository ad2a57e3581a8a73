"""The probe's report from its cell JSONs: Markdown + CSV tables and PNG plots, in the style
of ``launch.report`` (its ``Table`` and plot helpers are reused, not copied).

Tables: accuracy by distance per retrieval experiment, the marked copy's accuracy at d1 and d2,
every learned layer's alpha (start, end, largest excursion) with the rung distance nearest the
trained band at the start and the end, and a one-line-per-cell summary of how far alpha moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

from fibjax.attention import offsets
from fibjax.eval import plots
from fibjax.eval.report import Table, _num
from fibjax.probe import geometry
from fibjax.probe.cell import CONDITIONS
from fibjax.probe.tasks import ProbeError


def load_cells(out: Path) -> list[dict]:
    """Every cell JSON under ``out`` (``<experiment>/<name>.json``), in grid order."""
    order = {c: i for i, c in enumerate(CONDITIONS)}
    cells = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*/*.json"))]
    return sorted(cells, key=lambda c: (c["experiment"], c["depth"], order.get(c["condition"], len(order))))


def _by_experiment(cells: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in cells:
        out.setdefault(c["experiment"], []).append(c)
    return out


def _band_text(bands) -> str:
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in bands)


def _in_band_mean(cell: dict) -> float | None:
    acc = dict(zip(cell["accuracy"]["distances"], cell["accuracy"]["accuracy"]))
    vals = [acc[d] for d in cell["train_distances"] if d in acc]
    return float(np.mean(vals)) if vals else None


def _partial_bands(cell: dict) -> list[list[int]]:
    """The trained bands, when they leave some read distance out (else nothing to mark)."""
    return cell["bands"] if not set(cell["accuracy"]["distances"]) <= set(cell["train_distances"]) else []


def _rungs_at_one(cell: dict) -> list[int]:
    spec = cell["spec"]
    return [d for d in offsets.attended_distances(window=spec["window"], base="fibonacci", alpha=1.0, seq_len=spec["seq_len"]) if d > spec["window"]]


def _columns(cells: list[dict]) -> list[int]:
    """Distances shown in a Markdown table: the trained band(s) and the alpha = 1 Fibonacci rungs."""
    wanted = set(_rungs_at_one(cells[0]))
    for c in cells:
        for lo, hi in _partial_bands(c):
            wanted.update({lo, (lo + hi) // 2, hi})
    return sorted(wanted & set(cells[0]["accuracy"]["distances"]))


def _columns_note(cols: list[int], rungs: set[int]) -> str:
    """What the table's @d columns are: only the kinds of distance it has."""
    kinds = []
    if band := [d for d in cols if d not in rungs]:
        kinds.append(f"the edges and centre of a band that leaves some read distance out ({', '.join(map(str, band))})")
    if on_rungs := [d for d in cols if d in rungs]:
        kinds.append(f"the alpha = 1 Fibonacci rungs among the read distances ({', '.join(map(str, on_rungs))})")
    if not kinds:
        return "Every distance's accuracy is in the CSV."
    return f"Columns @d, the accuracy at distance d: {'; '.join(kinds)}; every distance is in the CSV."


def accuracy_table(experiment: str, cells: list[dict]) -> Table:
    cols = _columns(cells)
    header = ["condition", "depth", "trained", "in band", "all", *(f"@{d}" for d in cols)]
    rows, csv_rows = [], []
    for c in cells:
        acc = dict(zip(c["accuracy"]["distances"], c["accuracy"]["accuracy"]))
        rows.append(
            [
                c["condition"],
                str(c["depth"]),
                _band_text(c["bands"]),
                _num(_in_band_mean(c)),
                _num(float(np.mean(list(acc.values())))),
                *(_num(acc[d]) for d in cols),
            ]
        )
        csv_rows += [[experiment, c["condition"], c["depth"], d, a] for d, a in acc.items()]
    chance = cells[0]["accuracy"]["chance"]
    notes = [
        f"Forced-choice accuracy at the query among the {round(1 / chance)} values present (chance {chance:.2f}), "
        f"{cells[0]['accuracy']['examples']} sequences per distance; 'in band': mean over the trained distances, 'all': over every distance read. "
        + _columns_note(cols, set(_rungs_at_one(cells[0])))
    ]
    return Table(
        f"accuracy_{experiment}",
        f"{experiment}: accuracy by distance",
        header,
        rows,
        ["experiment", "condition", "depth", "distance", "accuracy"],
        csv_rows,
        notes,
    )


def marked_table(cells: list[dict]) -> Table:
    d1, d2 = cells[0]["accuracy"]["distances"]
    header = ["condition", "depth", f"acc@{d1}", f"acc@{d2}", "alpha (end)"]
    rows, csv_rows = [], []
    for c in cells:
        a1, a2 = c["accuracy"]["accuracy"]
        rows.append([c["condition"], str(c["depth"]), _num(a1), _num(a2), _alpha_range(c["alpha_final"])])
        csv_rows.append([c["condition"], c["depth"], d1, a1, d2, a2, " ".join(f"{a:.4f}" for a in c["alpha_final"])])
    notes = [f"Argmax over the full vocabulary at every position that copies from d1 = {d1} or d2 = {d2} (chance {cells[0]['accuracy']['chance']:.4f})."]
    return Table(
        "marked",
        f"marked copy: accuracy at d1 = {d1} and d2 = {d2}",
        header,
        rows,
        ["condition", "depth", "d1", "acc_d1", "d2", "acc_d2", "alphas"],
        csv_rows,
        notes,
    )


def _alpha_range(alphas: list[float]) -> str:
    return "—" if not alphas else f"{min(alphas):.3f}-{max(alphas):.3f}" if len(alphas) > 1 else f"{alphas[0]:.3f}"


def _excursion(cell: dict) -> list[float]:
    """Per layer, the largest |alpha - initial alpha| seen during training."""
    traj = np.asarray(cell["alpha_trajectory"]["alphas"])
    return list(np.abs(traj - np.asarray(cell["alpha_init"])).max(axis=0)) if len(traj) else []


def alpha_table(cells: list[dict]) -> Table:
    """Every learned layer: alpha start -> end, and its rungs against each trained band."""
    header = [
        "experiment",
        "condition",
        "depth",
        "layer",
        "alpha init",
        "alpha end",
        "max |change|",
        "band",
        "nearest rung: init -> end",
        "outside band by: init -> end",
        "alpha that puts a rung on the centre",
    ]
    rows, csv_rows = [], []
    for c in (c for c in cells if c["learned"]):
        exc = _excursion(c)
        for start, end in zip(c["geometry"]["init"]["bands"], c["geometry"]["final"]["bands"]):
            for layer, (s, e) in enumerate(zip(start["layers"], end["layers"])):
                rows.append(
                    [
                        c["experiment"],
                        c["condition"],
                        str(c["depth"]),
                        str(layer),
                        f"{s['alpha']:.4f}",
                        f"{e['alpha']:.4f}",
                        f"{exc[layer]:.4f}",
                        _band_text([start["band"]]),
                        f"{s['nearest_distance']} -> {e['nearest_distance']}",
                        f"{s['distance_to_band']} -> {e['distance_to_band']}",
                        _num(e["alpha_for_centre"], 3),
                    ]
                )
                csv_rows.append(
                    [
                        c["experiment"],
                        c["condition"],
                        c["depth"],
                        layer,
                        s["alpha"],
                        e["alpha"],
                        exc[layer],
                        *start["band"],
                        s["nearest_distance"],
                        e["nearest_distance"],
                        s["distance_to_band"],
                        e["distance_to_band"],
                        e["alpha_for_centre"],
                    ]
                )
    notes = [
        "A layer's rungs sit at round(alpha * f); 'outside band by' is how far its rung nearest the band's centre is from the band "
        "(0: a rung is on the band). The last column is the alpha nearest the layer's own that puts a rung exactly on the centre."
    ]
    return Table(
        "alpha",
        "Learned alpha: start, end, and distance to the rewarded band",
        header,
        rows,
        [
            "experiment",
            "condition",
            "depth",
            "layer",
            "alpha_init",
            "alpha_end",
            "max_abs_change",
            "band_lo",
            "band_hi",
            "nearest_init",
            "nearest_end",
            "outside_init",
            "outside_end",
            "alpha_for_centre",
        ],
        csv_rows,
        notes,
    )


def _relay_text(cell: dict, when: str) -> str:
    """Per trained band, how many of its distances the stack can relay over (``stack_reach``)."""
    return ", ".join(f"{len(b['stack_reaches'])}/{b['band'][1] - b['band'][0] + 1}" for b in cell["geometry"][when]["bands"])


def summary_table(cells: list[dict]) -> Table:
    """One row per learned cell: the paper's 'learned alpha range' figure and the largest move."""
    header = ["experiment", "condition", "depth", "alpha init", "alpha end (range)", "max |change|", "a rung on it", "relay reach: init -> end"]
    rows, csv_rows = [], []
    for c in (c for c in cells if c["learned"]):
        reached = any(lay["covers_band"] for band in c["geometry"]["final"]["bands"] for lay in band["layers"])
        was = any(lay["covers_band"] for band in c["geometry"]["init"]["bands"] for lay in band["layers"])
        exc = max(_excursion(c), default=0.0)
        rows.append(
            [
                c["experiment"],
                c["condition"],
                str(c["depth"]),
                _alpha_range(c["alpha_init"]),
                _alpha_range(c["alpha_final"]),
                f"{exc:.4f}",
                "at init" if was else ("yes" if reached else "no"),
                f"{_relay_text(c, 'init')} -> {_relay_text(c, 'final')}",
            ]
        )
        csv_rows.append(
            [
                c["experiment"],
                c["condition"],
                c["depth"],
                min(c["alpha_init"]),
                max(c["alpha_init"]),
                min(c["alpha_final"]),
                max(c["alpha_final"]),
                exc,
                was,
                reached,
                _relay_text(c, "init"),
                _relay_text(c, "final"),
            ]
        )
    notes = [
        "'a rung on it': some layer has a rung on a trained band (or distance) at the end of training ('at init': already at the start). "
        "'relay reach': per trained band, how many of its distances are a sum of one attended distance per layer (window included), "
        "i.e. reachable by relaying a token through the stack, with the alphas at the start and at the end."
    ]
    return Table(
        "alpha_summary",
        "Did alpha move?",
        header,
        rows,
        [
            "experiment",
            "condition",
            "depth",
            "init_min",
            "init_max",
            "end_min",
            "end_max",
            "max_abs_change",
            "rung_at_init",
            "rung_at_end",
            "relay_init",
            "relay_end",
        ],
        csv_rows,
        notes,
    )


def build_tables(cells: list[dict]) -> list[Table]:
    tables = []
    for experiment, group in _by_experiment(cells).items():
        tables.append(marked_table(group) if group[0]["task"] == "marked" else accuracy_table(experiment, group))
    if any(c["learned"] for c in cells):
        tables += [summary_table(cells), alpha_table(cells)]
    return tables


# --- plots --------------------------------------------------------------------------------------


def _depth_panels(cells: list[dict], height: float = 4.0):
    depths = sorted({c["depth"] for c in cells})
    fig, axes = plots._panels(len(depths), width=6.0, height=height)
    return depths, fig, axes[0]


def plot_accuracy(experiment: str, cells: list[dict], path: Path, styles) -> bool:
    depths, fig, axes = _depth_panels(cells)
    for ax, depth in zip(axes, depths):
        group = [c for c in cells if c["depth"] == depth]
        for lo, hi in _partial_bands(group[0]):
            ax.axvspan(lo - 0.5, hi + 0.5, color="#000000", alpha=0.08, zorder=0)
        for d in _rungs_at_one(group[0]):
            ax.axvline(d, color=plots.GUIDE, linewidth=0.6, alpha=0.5, zorder=0)
        ax.axhline(group[0]["accuracy"]["chance"], color=plots.GUIDE, linestyle=":", linewidth=1.2, zorder=0)
        for c in group:
            s = styles[c["condition"]]
            ax.plot(c["accuracy"]["distances"], c["accuracy"]["accuracy"], color=s.color, linestyle=s.linestyle, linewidth=1.6, label=c["condition"])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("distance from the query to the value")
        ax.set_ylabel("forced-choice accuracy")
        ax.set_title(f"depth {depth}", fontsize=11)
    shaded = "shaded: trained distances; " if any(_partial_bands(c) for c in cells) else ""
    fig.suptitle(f"{experiment}: accuracy by distance\n{shaded}dotted: chance; thin lines: Fibonacci rungs at alpha = 1", fontsize=11)
    plots._legend(fig, axes)
    return plots._save(fig, path)


def plot_marked(cells: list[dict], path: Path, styles) -> bool:
    depths, fig, axes = _depth_panels(cells)
    d1, d2 = cells[0]["accuracy"]["distances"]
    for ax, depth in zip(axes, depths):
        group = [c for c in cells if c["depth"] == depth]
        x = np.arange(len(group))
        for k, (d, hatch) in enumerate(((d1, ""), (d2, "//"))):
            ax.bar(
                x + (k - 0.5) * 0.38,
                [c["accuracy"]["accuracy"][k] for c in group],
                0.38,
                hatch=hatch,
                edgecolor="white",
                color=[styles[c["condition"]].color for c in group],
                label=f"d = {d}",
            )
        ax.set_xticks(x, [c["condition"] for c in group], rotation=30, ha="right")
        ax.set_ylim(0, 1.03)
        ax.set_ylabel("copy accuracy")
        ax.set_title(f"depth {depth} (plain: d = {d1}, hatched: d = {d2})", fontsize=11)
    fig.suptitle("marked two-distance copy")
    return plots._save(fig, path)


def plot_alpha_trajectories(experiment: str, cells: list[dict], path: Path) -> bool:
    """Every learned layer's alpha against the step: a row per learned condition, a column per depth."""
    learned = [c for c in cells if c["learned"]]
    if not learned:
        return False
    depths = sorted({c["depth"] for c in learned})
    conds = [k for k in CONDITIONS if any(c["condition"] == k for c in learned)]
    fig, axes = plots._panels(len(depths), rows=len(conds), width=5.0, height=3.4)
    for j, depth in enumerate(depths):
        for i, cond in enumerate(conds):
            ax = axes[i][j]
            cell = next((c for c in learned if (c["depth"], c["condition"]) == (depth, cond)), None)
            ax.set_title(f"{cond}, depth {depth}", fontsize=10)
            if cell is None:
                ax.set_visible(False)
                continue
            spec = cell["spec"]
            targets = {
                min(max(c / f, lo), hi)
                for c in ((lo_d + hi_d) // 2 for lo_d, hi_d in cell["bands"])
                for f, lo, hi in geometry.alphas_for(c, window=spec["window"], base="fibonacci", seq_len=spec["seq_len"])
            }
            for a in sorted(targets):
                ax.axhline(a, color=plots.GUIDE, linestyle="--", linewidth=1, zorder=0)
            steps, traj = cell["alpha_trajectory"]["steps"], np.asarray(cell["alpha_trajectory"]["alphas"])
            for layer in range(traj.shape[1]):
                ax.plot(steps, traj[:, layer], color=plots.PALETTE[layer % len(plots.PALETTE)], linewidth=1.6, label=f"layer {layer}")
            ax.set_ylim(0.45, 1.55)
            ax.set_xlabel("step")
            ax.set_ylabel("alpha")
    fig.suptitle(f"{experiment}: learned alpha during training\ndashed: the alphas that put a rung on the centre of a trained band", fontsize=12)
    plots._legend(fig, axes)
    return plots._save(fig, path)


def plot_loss(experiment: str, cells: list[dict], path: Path, styles) -> bool:
    depths, fig, axes = _depth_panels(cells, height=3.6)
    for ax, depth in zip(axes, depths):
        for c in (c for c in cells if c["depth"] == depth):
            s = styles[c["condition"]]
            steps, loss = c["loss_trajectory"]["steps"], c["loss_trajectory"]["loss"]
            ax.plot(steps, plots.smooth(loss, 5), color=s.color, linestyle=s.linestyle, linewidth=1.6, label=c["condition"])
        ax.set_xlabel("step")
        ax.set_ylabel("training loss at the read positions")
        ax.set_title(f"depth {depth}", fontsize=11)
    fig.suptitle(f"{experiment}: training loss")
    plots._legend(fig, axes)
    return plots._save(fig, path)


def distances_section(cells: list[dict]) -> list[str]:
    """What each experiment trained on, and which alphas would put a rung there."""
    spec = cells[0]["spec"]
    t, w = spec["seq_len"], spec["window"]
    at_one = offsets.attended_distances(window=w, base="fibonacci", alpha=1.0, seq_len=t)
    lines = [f"- T = {t}, W = {w}; distances a Fibonacci layer attends at alpha = 1: {list(at_one)}."]
    for experiment, group in _by_experiment(cells).items():
        c = group[0]
        how = [c["task"]]
        if c["spec"].get("soft_width"):
            how.append(f"soft-width relaxation from width {c['spec']['soft_width']:g}")
        if c["spec"].get("alpha_lr_multiplier", 1.0) != 1.0:
            how.append(f"alpha lr x{c['spec']['alpha_lr_multiplier']:g}")
        lines.append(f"- {experiment} ({', '.join(how)}): trained on {_band_text(c['bands'])}.")
        if len(c["train_distances"]) < t // 2:
            for lo, hi in c["bands"]:
                centre = (lo + hi) // 2
                lines.append(f"  - {_reach_text(centre, w, t)}")
    return lines


def _reach_text(distance: int, window: int, seq_len: int) -> str:
    """Which alphas put a Fibonacci rung on ``distance``, or why none needs to or can."""
    if distance <= window:
        return f"distance {distance} is inside the dense window (0-{window}): a Fibonacci layer attends it at every alpha."
    if distance > seq_len - 1:
        return f"distance {distance} is past the sequence (T - 1 = {seq_len - 1})."
    reach = "; ".join(f"f = {f}: alpha {a:.3f}-{b:.3f}" for f, a, b in geometry.alphas_for(distance, window=window, base="fibonacci", seq_len=seq_len))
    if not reach:
        return f"distance {distance}: no alpha in [{offsets.ALPHA_MIN}, {offsets.ALPHA_MAX}] puts a Fibonacci rung on it."
    return f"distance {distance} is put on a rung by {reach}."


def build_report(out: Path, *, make_plots: bool = True) -> tuple[list[Table], list[Path], str]:
    """Read every cell under ``out``; write report.md, the CSVs and the PNGs there."""
    out = Path(out)
    cells = load_cells(out)
    if not cells:
        raise ProbeError(f"no probe cell JSON under {out}/<experiment>/")
    tables = build_tables(cells)
    written = [t.write_csv(out) for t in tables]
    figures: list[tuple[str, Path]] = []
    if make_plots:
        styles = plots.run_styles(list(CONDITIONS))
        with matplotlib.rc_context(plots.STYLE):
            for experiment, group in _by_experiment(cells).items():
                if group[0]["task"] == "marked":
                    made = [("marked copy: accuracy at d1 and d2", out / "marked.png", lambda p: plot_marked(group, p, styles))]
                else:
                    made = [(f"{experiment}: accuracy by distance", out / f"accuracy_{experiment}.png", lambda p: plot_accuracy(experiment, group, p, styles))]
                made.append(
                    (f"{experiment}: learned alpha during training", out / f"alpha_{experiment}.png", lambda p: plot_alpha_trajectories(experiment, group, p))
                )
                made.append((f"{experiment}: training loss", out / f"loss_{experiment}.png", lambda p: plot_loss(experiment, group, p, styles)))
                figures += [(t, p) for t, p, fn in made if fn(p)]
        written += [p for _, p in figures]
    markdown = render(cells, tables, figures)
    (out / "report.md").write_text(markdown)
    return tables, [*written, out / "report.md"], markdown


def render(cells: list[dict], tables: list[Table], figures: list[tuple[str, Path]]) -> str:
    spec = cells[0]["spec"]
    lines = [
        "# fibjax retrieval probe",
        "",
        f"{len(cells)} cells. Model: d_model {spec['d_model']}, {spec['num_heads']} heads, {spec['num_kv_heads']} KV heads, window {spec['window']}, "
        f"sequence {spec['seq_len']}; {spec['steps']} steps of {spec['batch']} sequences, lr {spec['lr']}, seed {spec['seed']} "
        "(each cell's JSON holds its full spec).",
        "",
    ]
    lines += ["## Distances", "", *distances_section(cells), ""]
    for t in tables:
        lines += [t.markdown(), "", f"CSV: [{t.name}.csv]({t.name}.csv)", ""]
    if figures:
        lines += ["## Plots"]
        for title, path in figures:
            lines += ["", f"### {title}", "", f"![{title}]({path.name})"]
    return "\n".join(lines) + "\n"
