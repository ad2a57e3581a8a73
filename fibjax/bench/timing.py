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


def measure(fn: Callable, *args, repeats: int = 5) -> Measurement:
    """Compile ``fn`` (jitted) once, warm up once, then time ``repeats`` calls."""
    jitted = jax.jit(fn)
    compiled = jitted.lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes) if mem else float("nan")
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return Measurement(statistics.median(times), max(times) - min(times), peak / 2**20)
