"""Timing and memory measurement shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax


@dataclass
class Measurement:
    ms: float  # median wall time of one call
    spread_ms: float  # max - min over the repeats
    peak_mb: float  # XLA's buffer assignment: arguments + outputs + temporaries (not aliased)
    round_ms: tuple[float, ...] = ()  # each round's median, when timed in interleaved rounds


def ratio(num: Measurement, den: Measurement) -> float:
    """num / den: the median of the per-round ratios when both were timed in the same rounds (each
    round's pair saw the same load), else the ratio of the medians."""
    if num.round_ms and len(num.round_ms) == len(den.round_ms):
        return statistics.median(n / d for n, d in zip(num.round_ms, den.round_ms))
    return num.ms / den.ms


class CallTimer:
    """A blocking ``call`` (returns once its work is done) warmed up once; each ``times`` call
    runs it ``repeats`` times. Several timers interleaved round by round see the same load, so
    their ratios stay fair on a shared machine. ``peak_mb``: nan unless a subclass measures it."""

    peak_mb = float("nan")

    def __init__(self, call: Callable[[], object]):
        self._call = call
        call()  # warm up

    def times(self, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            self._call()
            out.append((time.perf_counter() - start) * 1e3)
        return out

    def measurement(self, rounds_ms: list[list[float]]) -> Measurement:
        return of_rounds(rounds_ms, self.peak_mb)


class Timer(CallTimer):
    """``fn`` (jitted) compiled once, its peak memory read from XLA's buffer assignment, and timed
    as a ``CallTimer`` until its outputs are ready; ``compiled`` is the program itself."""

    def __init__(self, fn: Callable, *args):
        self.compiled = compiled = jax.jit(fn).lower(*args).compile()
        mem = compiled.memory_analysis()
        self.peak_mb = (
            (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / 2**20 if mem else float("nan")
        )
        super().__init__(lambda: jax.block_until_ready(compiled(*args)))


def of_rounds(rounds_ms: list[list[float]], peak_mb: float) -> Measurement:
    """The median over rounds of each round's median; the spread is over every call."""
    every = [t for r in rounds_ms for t in r]
    medians = tuple(statistics.median(r) for r in rounds_ms)
    return Measurement(statistics.median(medians), max(every) - min(every), peak_mb, medians if len(medians) > 1 else ())


def measure(fn: Callable, *args, repeats: int = 5) -> Measurement:
    """Compile ``fn`` (jitted) once, warm up once, then time ``repeats`` calls."""
    timer = Timer(fn, *args)
    return timer.measurement([timer.times(repeats)])
