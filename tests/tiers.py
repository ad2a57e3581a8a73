"""The suite's two tiers.

``python -m pytest -n 2 -m "not slow"`` (the README's command) runs the fast tier: every path
against its reference at least once, every command end to end at least once. It took 13:15 on
2 cores beside a training job, with a cold compilation cache; the budget is ~10 minutes.
``-m slow`` runs the rest: more shapes, dtypes and parameters of paths the fast tier already
checks, hypothesis sweeps, and the long fault runs (kills, full disks, 2-process jobs). CI runs
both tiers.
"""

import pytest

slow = pytest.mark.slow


def first_fast(values, keep: int = 1, *, unpack: bool = False) -> list:
    """``parametrize`` values: the first ``keep`` in the fast tier, the rest marked slow.
    ``unpack``: each value is the tuple of a multi-argument ``parametrize``."""
    return [v if i < keep else pytest.param(*(v if unpack else (v,)), marks=slow) for i, v in enumerate(values)]
