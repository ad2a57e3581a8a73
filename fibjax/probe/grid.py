"""The probe's experiments and its resumable grid (experiments x conditions x depths).

Experiments (all at the grid's sequence length T and window W):

- ``band``: retrieval trained on a band of distances that no rung covers at alpha = 1 but on
  which some alpha in [0.5, 1.5] puts a rung (``geometry.gap_centres``; by default the one
  farthest from every alpha = 1 rung), read at every distance. The inertness test.
- ``multiband``: retrieval trained on every gap band at once (one band drawn per step).
- ``coverage``: retrieval trained on distances uniform over 1..T-2: which distances a
  condition can retrieve at all.
- ``marked``: the marked two-distance copy at the two gap centres farthest from the rungs.
- ``soft`` (stretch): ``band`` for the learned conditions, trained with the soft-width
  relaxation (``soft_width``: rungs as Gaussian bumps, annealed to hard), scored hard.

A cell's JSON is ``OUT/<experiment>/<condition>_L<depth>.json``; a cell whose JSON exists is
skipped, so an interrupted grid resumes where it stopped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fibjax.attention import offsets
from fibjax.config import AttentionConfig
from fibjax.probe import geometry
from fibjax.probe.cell import CONDITIONS, CellSpec, run_cell
from fibjax.probe.tasks import Band, ProbeError, max_retrieval_distance

EXPERIMENTS = ("band", "marked", "coverage", "multiband", "soft")
DEFAULT_EXPERIMENTS = ("band", "marked")


@dataclass(frozen=True)
class GridOptions:
    experiments: tuple[str, ...] = DEFAULT_EXPERIMENTS
    conditions: tuple[str, ...] = tuple(CONDITIONS)
    depths: tuple[int, ...] = (2, 4)
    seq_len: int = 64
    window: int = 8
    band_width: int = 4
    # explicit choices override the automatic ones: band centres (band/multiband), (d1, d2) (marked)
    band_centres: tuple[int, ...] = ()
    marked_distances: tuple[int, ...] = ()
    steps: int = 800
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    soft_width: float = 8.0  # the ``soft`` experiment's initial bump width
    # the learned alphas' lr multiplier; another value than 1 runs as experiment "<name>_alr<m>"
    alpha_lr_multiplier: float = 1.0

    def __post_init__(self):
        bad = [e for e in self.experiments if e not in EXPERIMENTS] + [c for c in self.conditions if c not in CONDITIONS]
        if bad:
            raise ProbeError(f"unknown experiment or condition {bad}; experiments: {EXPERIMENTS}, conditions: {tuple(CONDITIONS)}")


def ranked_gap_centres(opts: GridOptions, width: int) -> list[int]:
    """Gap centres (``geometry.gap_centres``), farthest from any alpha = 1 rung first."""
    rungs = [d for d in offsets.attended_distances(window=opts.window, base="fibonacci", alpha=1.0, seq_len=opts.seq_len) if d > opts.window]
    gaps = geometry.gap_centres(window=opts.window, base="fibonacci", seq_len=opts.seq_len, width=width, max_distance=max_retrieval_distance(opts.seq_len))
    return sorted(gaps, key=lambda c: (-min(abs(c - r) for r in rungs), c))


def band_centres(opts: GridOptions, experiment: str) -> list[int]:
    if opts.band_centres:
        return list(opts.band_centres)
    ranked = ranked_gap_centres(opts, opts.band_width)
    return ranked[:1] if experiment in ("band", "soft") else sorted(ranked)


def marked_pair(opts: GridOptions) -> tuple[int, int]:
    return tuple(opts.marked_distances) if opts.marked_distances else tuple(sorted(ranked_gap_centres(opts, 0)[:2]))


def cell_specs(opts: GridOptions, experiment: str) -> list[CellSpec]:
    common = dict(
        seq_len=opts.seq_len, window=opts.window, steps=opts.steps, batch=opts.batch, lr=opts.lr, seed=opts.seed, alpha_lr_multiplier=opts.alpha_lr_multiplier
    )
    if experiment == "marked":
        task = dict(task="marked", marked_distances=marked_pair(opts))
    elif experiment == "coverage":
        task = dict(task="retrieval", bands=((1, max_retrieval_distance(opts.seq_len)),))
    else:
        bands = [Band.around(c, opts.band_width) for c in band_centres(opts, experiment)]
        task = dict(task="retrieval", bands=tuple((b.lo, b.hi) for b in bands))
    conditions = opts.conditions
    if experiment == "soft":
        conditions = [c for c in conditions if AttentionConfig(**CONDITIONS[c]).is_learned]
        common["soft_width"] = opts.soft_width
    name = experiment if opts.alpha_lr_multiplier == 1 else f"{experiment}_alr{opts.alpha_lr_multiplier:g}"
    return [CellSpec(experiment=name, condition=c, depth=d, **task, **common) for d in opts.depths for c in conditions]


def smoke_spec(seed: int = 0) -> CellSpec:
    """One small cell (well under a minute on 2 cores): dense, depth 2, retrieval at 2..8."""
    return CellSpec(
        experiment="smoke",
        task="retrieval",
        condition="dense",
        depth=2,
        bands=((2, 8),),
        eval_distances=(2, 4, 6, 8),
        seq_len=32,
        d_model=64,
        steps=500,
        batch=32,
        lr=3e-3,
        warmup_steps=30,
        eval_examples=128,
        seed=seed,
    )


def cell_path(out: Path, spec: CellSpec) -> Path:
    return Path(out) / spec.experiment / f"{spec.name}.json"


def write_json(path: Path, record: dict) -> None:
    """Atomic: a cell's JSON exists only once it is complete (the grid's resume test)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def plan(opts: GridOptions) -> str:
    """The geometry behind the grid's distances, for the terminal and the report."""
    t, w = opts.seq_len, opts.window
    at_one = offsets.attended_distances(window=w, base="fibonacci", alpha=1.0, seq_len=t)
    cands = geometry.band_candidates(window=w, base="fibonacci", seq_len=t, width=opts.band_width, max_distance=max_retrieval_distance(t))
    lines = [
        f"T = {t}, W = {w}. Distances attended at alpha = 1 (fibonacci): {list(at_one)}.",
        f"Band centres (width {opts.band_width}) that no alpha = 1 rung covers and some alpha in [0.5, 1.5] puts a rung on: {cands}.",
        f"One per gap, farthest from the rungs first: {ranked_gap_centres(opts, opts.band_width)}.",
    ]
    chosen = {e: band_centres(opts, e) for e in opts.experiments if e in ("band", "multiband", "soft")}
    if "marked" in opts.experiments:
        chosen["marked"] = list(marked_pair(opts))
    for experiment, centres in chosen.items():
        for c in centres:
            reach = ", ".join(f"f={f}: alpha {lo:.3f}-{hi:.3f}" for f, lo, hi in geometry.alphas_for(c, window=w, base="fibonacci", seq_len=t))
            lines.append(f"{experiment}: distance {c} is put on a rung by {reach}.")
    return "\n".join(lines)


def run_grid(opts: GridOptions, out: Path, log: Callable[[str], None] = print, *, only_missing: bool = True) -> list[Path]:
    """Run every cell whose JSON is missing, in experiment order; return the JSON paths."""
    specs = [s for e in opts.experiments for s in cell_specs(opts, e)]
    todo = [s for s in specs if not (only_missing and cell_path(out, s).exists())]
    log(f"probe grid: {len(specs)} cells, {len(specs) - len(todo)} done, {len(todo)} to run -> {out}")
    for i, spec in enumerate(todo, 1):
        log(f"[{i}/{len(todo)}] {spec.experiment}/{spec.name}")
        record = run_cell(spec, log)
        write_json(cell_path(out, spec), record)
        acc = record["accuracy"]
        log(
            f"[{i}/{len(todo)}] {spec.experiment}/{spec.name}: {record['seconds']['total']:.0f} s; alphas {[round(a, 3) for a in record['alpha_final']]}; "
            + (
                f"accuracy {dict(zip(acc['distances'], [round(a, 3) for a in acc['accuracy']]))}"
                if spec.task == "marked"
                else f"mean accuracy {sum(acc['accuracy']) / len(acc['accuracy']):.3f}"
            )
        )
    return [cell_path(out, s) for s in specs]
