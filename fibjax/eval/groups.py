"""Groups of runs for the report's per-run line plots (perplexity vs length, NLL by position).

A study of dozens of runs and evaluations drawn in one figure is unreadable; its author names the
runs that belong together (paper A's models at one seed, paper B's, the longer trainings), and the
report draws those figures once per group (``fibjax.eval.plots.plot_all``). Kept apart from the
plotting code so that a study file can name groups without importing matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass

from fibjax.config import ConfigError


@dataclass(frozen=True)
class FigureGroup:
    """Runs drawn together in the per-run line plots (perplexity vs length, NLL by position),
    where a report of many runs would be too crowded to read: ``name`` goes into the file names,
    ``title`` onto the figures, ``runs`` are run names (every evaluation of each but a
    ``--dropped-mass`` one: ``group_runs``), ``reference`` the run the position gaps are taken against."""

    name: str
    title: str
    runs: tuple[str, ...]
    reference: str | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ConfigError(f"figure group name {self.name!r}: letters, digits and _ only (it names files)")
        if self.reference is not None and self.reference not in self.runs:
            raise ConfigError(f"figure group {self.name}: reference {self.reference!r} is not one of its runs {list(self.runs)}")


def group_runs(runs, group: FigureGroup) -> list:
    """The evaluations of ``group``'s runs, in the group's order; an evaluation made for the
    dropped mass and error law (``--dropped-mass``, on fewer tokens) is left out where the run has
    another to draw."""
    chosen = []
    for name in group.runs:
        mine = [r for r in runs if r.report["run"] == name]
        plain = [r for r in mine if "dropped_mass" not in r.report]
        chosen += plain or mine
    return chosen
