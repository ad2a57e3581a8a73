"""One table of perplexity by length for several runs and evaluations, averaged over seeds.

The question "which is best past the training length: dense under a window, under sinks, under
RoPE scaling, or a model trained sparse?" needs every candidate side by side, at the same
lengths, over the same seeds. A ``SeedTable`` names its rows: a run (``"{seed}"`` where the seed
goes in its name) and one of that run's evaluations (its own attention and RoPE, or one of the
study's extra evaluations: ``launch.eval --attention ...`` / ``--rope ...``). Each cell is
exp(mean NLL) over the seeds every row has (the geometric mean of the seeds' perplexities), so
rows are compared on one set of seeds; a row whose runs are not trained yet is shown empty and
does not shrink the others' seeds. A row of its own seeds (a run trained at one seed only) is
shown at those, and says so.

Writes ``seed_table_NAME.csv`` (every seed's value, then the means) and a Markdown section for
the study's report (``fibjax.study``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fibjax.config import ConfigError

# nll[row label][seed][dataset][length] -> mean NLL per token
RowNLLs = Mapping[str, Mapping[int, Mapping[str, Mapping[int, float]]]]


@dataclass(frozen=True)
class SeedRow:
    """A row: ``run`` names a study run, with ``{seed}`` where a seed goes; ``evaluation`` is one
    of the run's extra evaluations (its ``launch.eval`` arguments), () for its own. ``seeds``: ()
    for the table's seeds, or the row's own (then outside the common-seed rule); a run name
    without ``{seed}`` is one run, so it names exactly one seed here."""

    label: str
    run: str
    evaluation: tuple[str, ...] = ()
    seeds: tuple[int, ...] = ()

    def __post_init__(self):
        if "{seed}" not in self.run and len(self.seeds) != 1:
            raise ConfigError(f"seed table row {self.label!r}: run {self.run!r} has no {{seed}}, so it must name its one seed (seeds=(S,))")

    def run_name(self, seed: int) -> str:
        return self.run.replace("{seed}", str(seed))

    def seeds_or(self, default: tuple[int, ...]) -> tuple[int, ...]:
        """The seeds the row is read at.

        Args:
            default: the table's seeds, or the seeds its means are taken over.

        Returns:
            The row's own seeds, or else ``default``.
        """
        return self.seeds or default


@dataclass(frozen=True)
class SeedTable:
    """Rows of perplexity at ``lengths`` on every dataset, averaged over the ``seeds`` all rows
    have: ``name`` goes into the file names, ``title`` into the report."""

    name: str
    title: str
    rows: tuple[SeedRow, ...]
    seeds: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ConfigError(f"seed table name {self.name!r}: letters, digits and _ only (it names files)")
        labels = [r.label for r in self.rows]
        if not self.rows or len(set(labels)) != len(labels):
            raise ConfigError(f"seed table {self.name}: needs rows with distinct labels, got {labels}")
        if not self.seeds or not self.lengths:
            raise ConfigError(f"seed table {self.name}: needs at least one seed and one length")

    def row_seeds(self, row: SeedRow) -> tuple[int, ...]:
        """The seeds a row is read at.

        Args:
            row: one of the table's rows.

        Returns:
            The row's own seeds, or else the table's.
        """
        return row.seeds_or(self.seeds)

    def run_names(self) -> set[str]:
        """Every run the table reads.

        Returns:
            The run names of every row at each of its seeds.
        """
        return {r.run_name(s) for r in self.rows for s in self.row_seeds(r)}


def common_seeds(table: SeedTable, nlls: RowNLLs) -> tuple[int, ...]:
    """The seeds the table's means are taken over.

    Args:
        table: the table.
        nlls: nll[row label][seed][dataset][length] of the rows with results.

    Returns:
        The table's seeds that every row of the table's seeds with any result has (a row not
        trained yet is left out of the rule, so it does not empty the table while it waits).
    """
    present = [set(nlls.get(r.label, {})) for r in table.rows if not r.seeds]
    present = [p for p in present if p]
    return tuple(s for s in table.seeds if all(s in p for p in present)) if present else ()


def mean_ppl(by_seed: Mapping[int, Mapping[str, Mapping[int, float]]], seeds: Sequence[int], dataset: str, length: int) -> float | None:
    """A row's perplexity over seeds: exp of the mean NLL (the seeds' geometric mean).

    Args:
        by_seed: nll[seed][dataset][length] of one row.
        seeds: the seeds to average over.
        dataset: the validation set.
        length: the evaluation length in tokens.

    Returns:
        The perplexity, or None unless every seed has this dataset and length.
    """
    values = [by_seed.get(s, {}).get(dataset, {}).get(length) for s in seeds]
    if not seeds or any(v is None for v in values):
        return None
    return math.exp(sum(values) / len(values))


def markdown(table: SeedTable, nlls: RowNLLs, datasets: Sequence[str]) -> str:
    """The table for the report.

    Args:
        table: the table.
        nlls: nll[row label][seed][dataset][length] of the rows with results.
        datasets: the columns, in order.

    Returns:
        Markdown: a row per ``SeedRow``, a column per dataset with its perplexities at every length.
    """
    seeds = common_seeds(table, nlls)
    lengths = " / ".join(f"{n:,}" for n in table.lengths)
    seed_text = ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds)) if seeds else "no seed yet"
    lines = [
        f"Perplexity at {lengths} tokens, exp(mean NLL) over {seed_text} (the seeds every row with "
        f'results has; "not yet": a row whose runs or evaluations are not done).',
        "",
        "| row | " + " | ".join(datasets) + " |",
        "|---|" + "---:|" * len(datasets),
    ]
    for row in table.rows:
        by_seed = nlls.get(row.label, {})
        row_seeds = row.seeds_or(seeds)
        cells = []
        for dataset in datasets:
            ppls = [mean_ppl(by_seed, row_seeds, dataset, n) for n in table.lengths]
            cells.append(" / ".join("-" if p is None else f"{p:.2f}" for p in ppls) if by_seed else "not yet")
        own = f" (seed{'s' if len(row.seeds) > 1 else ''} {', '.join(map(str, row.seeds))} only)" if row.seeds else ""
        lines.append(f"| {row.label}{own} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(table: SeedTable, nlls: RowNLLs, datasets: Sequence[str], path: Path) -> Path:
    """Every row's NLL and perplexity per seed, dataset and length, then its mean over the common seeds.

    Args:
        table: the table.
        nlls: nll[row label][seed][dataset][length] of the rows with results.
        datasets: the datasets to write.
        path: the CSV file to write.

    Returns:
        ``path``.
    """
    seeds = common_seeds(table, nlls)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["row", "run", "seed", "dataset", "length", "nll", "ppl"])
        for row in table.rows:
            by_seed = nlls.get(row.label, {})
            for seed in sorted(by_seed):
                for dataset in datasets:
                    for n in table.lengths:
                        if (v := by_seed[seed].get(dataset, {}).get(n)) is not None:
                            writer.writerow([row.label, row.run_name(seed), seed, dataset, n, f"{v:.6f}", f"{math.exp(v):.4f}"])
            row_seeds = row.seeds_or(seeds)
            for dataset in datasets:
                for n in table.lengths:
                    if (p := mean_ppl(by_seed, row_seeds, dataset, n)) is not None:
                        seed_text = "mean " + " ".join(map(str, row_seeds))
                        writer.writerow([row.label, row.run, seed_text, dataset, n, f"{math.log(p):.6f}", f"{p:.4f}"])
    return path
