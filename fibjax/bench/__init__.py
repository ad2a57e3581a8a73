"""Benchmarks behind ``python -m launch.bench``: side-by-side timings in one process."""

__all__: list[str] = []  # tools behind their launch entry point, not a library surface
