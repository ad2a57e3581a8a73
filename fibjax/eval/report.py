"""From evaluated run directories to the paper's tables (Markdown + CSV) and plots (PNG).

Input: one or more run directories, each with ``RUN/eval/<step>.json`` (written by
``fibjax.eval.runner``) and ``RUN/metrics.jsonl``; or an eval JSON file itself (for an
``<step>-<override>.json`` of an attention override). Output, in one directory:

- ``matrix.csv``   perplexity by dataset at each run's training length, one row per run
- ``extrap.csv``   perplexity at every evaluated length, change at the longest vs the first
- ``posloss.csv``  NLL in position bins at the training length, and the gap to a reference run
- ``alpha.csv``    alpha per layer (learned runs: the learned value and its initial value)
- ``new_distances.csv`` per layer and length, distances never attended at the training length
- ``error_law.csv`` per layer: attention error vs dropped mass (runs evaluated with --dropped-mass)
- ``*.png``        the plots of ``fibjax.eval.plots``; ``report.md`` holds all of it.
"""

from __future__ import annotations

import collections
import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from fibjax import kinds
from fibjax.attention import alpha as alpha_lib
from fibjax.errors import FibjaxError
from fibjax.run.curves import METRICS_FILE

_EVAL_NAME = re.compile(r"^(\d+)(?:-(.+))?\.json$")
_REQUIRED = ("run", "step", "train_seq_len", "lengths", "attention", "alphas", "datasets")
_ROW_KEYS = ("length", "tokens", "nll", "ppl", "bin_nll")


class ReportError(FibjaxError, ValueError):
    pass


@dataclass
class RunEval:
    """One evaluated run: its eval report, where it came from, and its training metrics."""

    label: str
    source: Path  # the eval JSON
    workdir: Path
    report: dict
    metrics: list[dict]

    @property
    def train_len(self) -> int:
        return int(self.report["train_seq_len"])

    def rows(self, dataset: str) -> list[dict]:
        return sorted(self.report["datasets"].get(dataset, []), key=lambda r: r["length"])

    def at_train_len(self, dataset: str) -> dict | None:
        return next((r for r in self.rows(dataset) if r["length"] == self.train_len), None)

    def attention_config(self):
        """The run's AttentionConfig, or None when this fibjax cannot read it (a kind not registered here)."""
        from fibjax.config import AttentionConfig, ConfigError, from_dict

        try:
            return from_dict(AttentionConfig, self.report["attention"])
        except ConfigError:
            return None

    def attention_label(self) -> str:
        acfg = self.attention_config()
        text = kinds.kind_of(acfg).label(acfg) if acfg is not None else str(self.report["attention"].get("kind", "?"))
        return text + (" [override]" if self.report.get("attention_override") else "")

    def initial_alphas(self) -> list[float] | None:
        """The initial alphas of a learned run: recorded, or else as the model really started them
        (``fibjax.attention.alpha.initial_alphas``, the evaluator's rule); None otherwise."""
        if self.report.get("alpha_init"):
            return [float(x) for x in self.report["alpha_init"]]
        acfg = self.attention_config()
        return None if acfg is None else alpha_lib.initial_alphas(acfg, len(self.report["alphas"]))


@dataclass
class Table:
    """A table in two forms: formatted cells for Markdown, raw values for CSV."""

    name: str
    title: str
    header: list[str]
    rows: list[list[str]]
    csv_header: list[str]
    csv_rows: list[list]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        align = ["---" if i == 0 or not _numeric_column(self.rows, i) else "---:" for i in range(len(self.header))]
        lines = [f"### {self.title}", "", _md_row(self.header), _md_row(align), *(_md_row(r) for r in self.rows)]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)

    def write_csv(self, directory: Path) -> Path:
        path = directory / f"{self.name}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.csv_header)
            writer.writerows(self.csv_rows)
        return path


@dataclass
class Report:
    runs: list[RunEval]
    tables: list[Table]
    skipped: list[str]
    written: list[Path]
    markdown: str


# ---------------------------------------------------------------------------------------------
# Loading


def find_eval(workdir: Path, step: int | None) -> Path | None:
    """The eval JSON of ``step`` (default: the latest), preferring the un-overridden one."""
    found = [(int(m.group(1)), m.group(2) is not None, p) for p in (workdir / "eval").glob("*.json") if (m := _EVAL_NAME.match(p.name))]
    if step is not None:
        found = [f for f in found if f[0] == step]
    return min(found, key=lambda f: (-f[0], f[1], f[2].name))[2] if found else None


def load_eval(path: Path) -> dict:
    """A validated eval report; anything malformed is a ReportError naming the file."""
    try:
        report = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(report, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(report).__name__}")
    missing = [k for k in _REQUIRED if k not in report]
    if missing:
        raise ReportError(f"{path}: not an evaluation report, missing {missing}")
    if not isinstance(report["datasets"], dict) or not report["datasets"]:
        raise ReportError(f"{path}: 'datasets' must be a non-empty object of dataset -> rows")
    for name, rows in report["datasets"].items():
        for i, row in enumerate(rows if isinstance(rows, list) else [None]):
            if not isinstance(row, dict) or any(k not in row for k in _ROW_KEYS):
                raise ReportError(f"{path}: datasets[{name!r}][{i}] must have the keys {list(_ROW_KEYS)}")
    return report


def load_metrics(workdir: Path) -> list[dict]:
    path = workdir / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{i}: not valid JSON ({e})") from e
    return rows


def load_runs(paths: list[str | Path], step: int | None = None) -> tuple[list[RunEval], list[str]]:
    """The evaluated runs, and a message for every run skipped because it has no evaluation."""
    runs, skipped = [], []
    for p in map(Path, paths):
        if p.is_file():
            source, workdir = p, p.parent.parent if p.parent.name == "eval" else p.parent
        elif p.is_dir():
            workdir, source = p, find_eval(p, step)
            if source is None:
                have = sorted(f.name for f in (p / "eval").glob("*.json")) if (p / "eval").is_dir() else []
                what = f"no evaluation for step {step} (has {have})" if step is not None and have else "no evaluation (RUN/eval/<step>.json)"
                skipped.append(f"{p}: {what}; run `python -m launch.eval --workdir {p}` first")
                continue
        else:
            raise ReportError(f"{p}: no such run directory or eval file")
        report = load_eval(source)
        tag = _EVAL_NAME.match(source.name)
        label = str(report["run"]) + (f" [{tag.group(2)}]" if tag and tag.group(2) else "")
        runs.append(RunEval(label, source, workdir, report, load_metrics(workdir)))
    _unique_labels(runs)
    return runs, skipped


def _unique_labels(runs: list[RunEval]) -> None:
    """Runs with the same label are told apart by the first suffix that makes them unique."""
    suffixes = (lambda r: r.workdir.name, lambda r: f"step {r.report['step']}", lambda r: f"{r.workdir.parent.name}/{r.workdir.name}@{r.report['step']}")
    for label in {r.label for r in runs}:
        same = [r for r in runs if r.label == label]
        if len(same) == 1:
            continue
        fits = next((f for f in suffixes if len({f(r) for r in same}) == len(same)), None)
        for i, r in enumerate(same):
            r.label = f"{label} ({fits(r) if fits else i + 1})"


def datasets_of(runs: list[RunEval], only: str | None = None) -> list[str]:
    names = list(dict.fromkeys(name for r in runs for name in r.report["datasets"]))
    if only is None:
        return names
    if only not in names:
        raise ReportError(f"--dataset {only}: not evaluated by any run; datasets: {names}")
    return [only]


def find_run(runs: list[RunEval], name: str) -> RunEval:
    """A run by label, run name or directory name."""
    for key in (lambda r: r.label, lambda r: r.report["run"], lambda r: r.workdir.name):
        match = [r for r in runs if key(r) == name]
        if len(match) == 1:
            return match[0]
    raise ReportError(f"--reference {name}: no single run by that name; runs: {[r.label for r in runs]}")


# ---------------------------------------------------------------------------------------------
# Tables


def matrix_table(runs: list[RunEval], datasets: list[str]) -> Table:
    header = ["run", "step", "attention", "trained at", *datasets]
    rows, csv_rows = [], []
    for r in runs:
        ppl = [(row or {}).get("ppl") for row in (r.at_train_len(d) for d in datasets)]
        rows.append([r.label, str(r.report["step"]), r.attention_label(), str(r.train_len), *(_num(p) for p in ppl)])
        csv_rows.append([r.label, r.report["step"], r.attention_label(), r.train_len, *ppl])
    notes = ["Perplexity on held-out tokens at each run's training length; — : not evaluated at that length."]
    note = other_samples_note(runs, datasets)
    if note:
        notes.append(note)
    csv_header = ["run", "step", "attention", "train_seq_len", *datasets]
    return Table("matrix", "Perplexity by dataset at the training length", header, rows, csv_header, csv_rows, notes)


def other_samples_note(runs: list[RunEval], datasets: list[str]) -> str | None:
    """A note naming the runs that scored another number of tokens of a dataset than most runs
    did (an evaluation capped by ``--max-tokens`` scores another sample of the text); None if none."""
    scored = {r.label: [(r.at_train_len(d) or {}).get("tokens") for d in datasets] for r in runs}
    usual = []
    for i in range(len(datasets)):
        counts = collections.Counter(t[i] for t in scored.values() if t[i] is not None)
        usual.append(counts.most_common(1)[0][0] if counts else None)
    others = {label: t for label, t in scored.items() if any(n is not None and n != u for n, u in zip(t, usual))}
    if not others:
        return None
    fmt = lambda t: " / ".join("—" if n is None else str(n) for n in t)  # noqa: E731
    listed = "; ".join(f"{label}: {fmt(t)}" for label, t in others.items())
    names = " / ".join(datasets)
    return f"Tokens scored per dataset ({names}): {fmt(usual)}, except {listed}. Compare perplexities only between runs that scored the same tokens."


def change_pct(rows: list[dict]) -> float:
    """Perplexity change at the longest length relative to the first, in percent."""
    return 100.0 * (rows[-1]["ppl"] / rows[0]["ppl"] - 1.0)


def extrap_table(runs: list[RunEval], datasets: list[str]) -> Table:
    header = ["run", "trained at", "lengths", *datasets]
    rows, csv_rows = [], []
    for r in runs:
        lengths = sorted({row["length"] for d in datasets for row in r.rows(d)})
        cells = []
        for d in datasets:
            ds_rows = r.rows(d)
            cells.append(" / ".join(f"{x['ppl']:.2f}" for x in ds_rows) + f" ({change_pct(ds_rows):+.1f}%)" if ds_rows else "—")
            for i, x in enumerate(ds_rows):
                change = change_pct(ds_rows[: i + 1])
                csv_rows.append([r.label, d, r.train_len, x["length"], x["length"] / r.train_len, x["tokens"], x["nll"], x["ppl"], change])
        rows.append([r.label, str(r.train_len), " / ".join(map(str, lengths)), *cells])
    csv_header = ["run", "dataset", "train_seq_len", "length", "multiplier", "tokens", "nll", "ppl", "change_vs_first_pct"]
    notes = [
        "Perplexity at each evaluation length on the same tokens; in brackets the change at the longest length vs the first. "
        + scored_tokens_note(runs, datasets)
    ]
    return Table("extrap", "Length extrapolation", header, rows, csv_header, csv_rows, notes)


def scored_tokens_note(runs: list[RunEval], datasets: list[str]) -> str:
    """Tokens scored per dataset, naming the runs that scored another number than the others."""
    parts = []
    for d in datasets:
        by_count = collections.defaultdict(list)  # tokens -> run labels
        for r in runs:
            for count in dict.fromkeys(x["tokens"] for x in r.rows(d)):
                by_count[count].append(r.label)
        if len(by_count) == 1:
            parts.append(f"{d} {next(iter(by_count))}")
            continue
        usual = max(by_count, key=lambda c: len(by_count[c]))
        others = "; ".join(f"{c} for {', '.join(by_count[c])}" for c in sorted(by_count) if c != usual)
        parts.append(f"{d} {usual} ({others})")
    return "Tokens scored: " + ", ".join(parts) + "."


def posloss_table(runs: list[RunEval], datasets: list[str], reference: RunEval | None = None) -> Table:
    nbins = max((len(row["bin_nll"]) for r in runs for d in datasets if (row := r.at_train_len(d))), default=0)
    bins = [f"bin {i + 1}" for i in range(nbins)]
    header = ["run", "dataset", "quantity", *bins, "all"]
    rows, csv_rows = [], []
    for d in datasets:
        ref = reference.at_train_len(d) if reference else None
        for r in runs:
            row = r.at_train_len(d)
            if row is None:
                continue
            rows.append([r.label, d, "NLL", *(f"{b:.3f}" for b in row["bin_nll"]), f"{row['nll']:.3f}"])
            gap = position_gap(row, ref) if ref is not None and r is not reference and r.train_len == reference.train_len else None
            for i, b in enumerate(row["bin_nll"]):
                csv_rows.append([r.label, d, r.train_len, i + 1, b, gap[i] if gap else ""])
            if gap:
                rows.append([r.label, d, f"minus {reference.label}", *(f"{g:+.3f}" for g in gap), f"{row['nll'] - ref['nll']:+.3f}"])
    notes = ["NLL in nats per token, in equal bins of positions over a window of the training length (bin 1 = the first positions)."]
    if reference:
        notes.append(
            f"'minus {reference.label}': this run's NLL minus the reference's, per bin; > 0 means worse than {reference.label}. "
            "Only between runs of the same training length, binning and number of tokens scored."
        )
    csv_header = ["run", "dataset", "length", "bin", "nll", f"gap_to_{reference.label}" if reference else "gap_to_reference"]
    return Table("posloss", "NLL by position at the training length", header, rows, csv_header, csv_rows, notes)


def position_gap(row: dict, ref: dict) -> list[float] | None:
    """Per-bin NLL of ``row`` minus ``ref``; None when the binnings differ, or the tokens scored
    (an evaluation capped by ``--max-tokens`` scored a different sample of the text)."""
    if len(row["bin_nll"]) != len(ref["bin_nll"]) or row.get("tokens") != ref.get("tokens"):
        return None
    return [a - b for a, b in zip(row["bin_nll"], ref["bin_nll"], strict=True)]


def alpha_table(runs: list[RunEval]) -> Table:
    with_alpha = [r for r in runs if any(a is not None for a in r.report["alphas"])]
    nlayers = max((len(r.report["alphas"]) for r in with_alpha), default=0)
    header = ["run", "alpha", *(f"L{i}" for i in range(nlayers)), "max |learned - init|"]
    rows, csv_rows = [], []
    for r in with_alpha:
        alphas, init = r.report["alphas"], r.initial_alphas()
        drift = max(abs(a - b) for a, b in zip(alphas, init, strict=True)) if init else None
        rows.append([r.label, "learned" if init else "schedule", *_pad([f"{a:.3f}" for a in alphas], nlayers), _num(drift, 3)])
        if init:
            rows.append([r.label, "init", *_pad([f"{a:.3f}" for a in init], nlayers), ""])
        for i, a in enumerate(alphas):
            csv_rows.append([r.label, i, a, init[i] if init else "", bool(init)])
    notes = [f"No alphas (dense attention): {', '.join(r.label for r in runs if r not in with_alpha)}."] if len(with_alpha) < len(runs) else []
    return Table("alpha", "Alpha per layer", header, rows, ["run", "layer", "alpha", "init", "learned"], csv_rows, notes)


def new_distance_table(runs: list[RunEval]) -> Table:
    """Per layer and evaluated length: distances attended there that training never attended."""
    nlayers = max((len(v) for r in runs for v in r.report.get("new_distances", {}).values()), default=0)
    header = ["run", "length", *(f"L{i}" for i in range(nlayers)), "total"]
    rows, csv_rows = [], []
    for r in runs:
        for length, per_layer in sorted(r.report.get("new_distances", {}).items(), key=lambda kv: int(kv[0])):
            rows.append([r.label, length, *_pad([str(n) for n in per_layer], nlayers), str(sum(per_layer))])
            csv_rows += [[r.label, int(length), i, n] for i, n in enumerate(per_layer)]
    notes = [
        "Distances (query minus key) a layer attends at that length but never attended at the training length, with its "
        "current alpha; dense and block-sparse layers reach every distance. 0: the layer only meets trained relative positions."
    ]
    missing = [r.label for r in runs if "new_distances" not in r.report]
    if missing:
        notes.append(f"Not recorded (evaluated before the count existed): {', '.join(missing)}.")
    return Table("new_distances", "Distances never attended in training", header, rows, ["run", "length", "layer", "new_distances"], csv_rows, notes)


def error_law_table(runs: list[RunEval]) -> Table | None:
    """Paper B's law per run, dataset and length: mean dropped mass, the fitted slope of
    ||o - o_dense|| on the dropped mass (mean over layers), the worst layer's R^2, and how many
    queries broke the bound 2 m max||v|| (``launch.eval --dropped-mass``). A run whose attention is
    not one softmax (NSA) has its dropped mass only, the law's columns empty."""
    with_law = [r for r in runs if "error_law" in r.report or "dropped_mass" in r.report]
    if not with_law:
        return None
    header = ["run", "dataset", "length", "mean dropped mass", "slope (mean of layers)", "min R^2", "bound violations", "queries"]
    rows, csv_rows = [], []
    for r in with_law:
        if "error_law" not in r.report:
            for name, by_length in r.report["dropped_mass"].items():
                for length, per_layer in sorted(by_length.items(), key=lambda kv: int(kv[0])):
                    rows.append([r.label, name, length, _num(sum(per_layer) / len(per_layer), 4), "—", "—", "—", "—"])
                    csv_rows += [[r.label, name, int(length), i, m, None, None, None, None] for i, m in enumerate(per_layer)]
            continue
        for name, by_length in r.report["error_law"].items():
            for length, layers in sorted(by_length.items(), key=lambda kv: int(kv[0])):
                rows.append(
                    [
                        r.label,
                        name,
                        length,
                        _num(sum(x["mean_mass"] for x in layers) / len(layers), 4),
                        _num(sum(x["slope"] for x in layers) / len(layers), 3),
                        _num(min(x["r2"] for x in layers), 3),
                        str(sum(x["bound_violations"] for x in layers)),
                        str(sum(x["queries"] for x in layers)),
                    ]
                )
                csv_rows += [
                    [r.label, name, int(length), i, x["mean_mass"], x["slope"], x["r2"], x["bound_violations"], x["queries"]] for i, x in enumerate(layers)
                ]
    notes = [
        "Per query and head: error = ||o - o_dense|| (the layer's own attention against dense, same q, k, v), m = dropped mass; "
        "slope = least squares of error = c m through the origin; the bound is 2 m max_{j<=i} ||v_j||."
    ]
    notes += [f"— : no law fitted for {r.label}: {r.report.get('error_law_skipped', 'not recorded why')}." for r in with_law if "error_law" not in r.report]
    return Table(
        "error_law",
        "Approximation error vs dropped mass (paper B)",
        header,
        rows,
        ["run", "dataset", "length", "layer", "mean_mass", "slope", "r2", "bound_violations", "queries"],
        csv_rows,
        notes,
    )


# ---------------------------------------------------------------------------------------------
# The whole report


def build_report(
    paths: list[str | Path],
    out: str | Path,
    *,
    reference: str | None = None,
    step: int | None = None,
    dataset: str | None = None,
    plots: bool = True,
    groups: tuple = (),
) -> Report:
    """Load the runs, write the CSVs, the PNGs and report.md into ``out``; return all of it.
    ``groups``: ``fibjax.eval.groups.FigureGroup``s for the per-run line plots of many runs."""
    runs, skipped = load_runs(paths, step)
    if not runs:
        raise ReportError("no evaluated run to report on:\n  " + "\n  ".join(skipped))
    datasets = datasets_of(runs, dataset)
    ref = find_run(runs, reference) if reference else None
    tables = [matrix_table(runs, datasets), extrap_table(runs, datasets), posloss_table(runs, datasets, ref), alpha_table(runs), new_distance_table(runs)]
    tables += [t for t in (error_law_table(runs),) if t is not None]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [t.write_csv(out) for t in tables]
    figures = []
    if plots:
        from fibjax.eval import plots as plot_lib

        figures = plot_lib.plot_all(runs, datasets, out, reference=ref, groups=groups)
        written += [path for _, path in figures]
    markdown = render_markdown(runs, tables, figures, skipped, ref)
    (out / "report.md").write_text(markdown)
    written.append(out / "report.md")
    return Report(runs, tables, skipped, written, markdown)


def render_markdown(runs: list[RunEval], tables: list[Table], figures: list[tuple[str, Path]], skipped: list[str], reference: RunEval | None) -> str:
    lines = ["# fibjax evaluation report", "", "| run | step | eval file |", "|---|---:|---|"]
    lines += [f"| {r.label} | {r.report['step']} | `{r.source}` |" for r in runs]
    if reference:
        lines += ["", f"Reference run for the position gaps: **{reference.label}**."]
    if skipped:
        lines += ["", "Skipped:", *(f"- {s}" for s in skipped)]
    for t in tables:
        lines += ["", t.markdown(), "", f"CSV: [{t.name}.csv]({t.name}.csv)"]
    if figures:
        lines += ["", "## Plots"]
        for title, path in figures:
            lines += ["", f"### {title}", "", f"![{title}]({path.name})"]
    return "\n".join(lines) + "\n"


def _num(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _pad(cells: list[str], n: int) -> list[str]:
    return cells + [""] * (n - len(cells))


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _numeric_column(rows: list[list[str]], i: int) -> bool:
    cells = [r[i] for r in rows if i < len(r) and r[i] not in ("", "—")]
    return bool(cells) and all(re.match(r"^[+-]?\d", c) for c in cells)
