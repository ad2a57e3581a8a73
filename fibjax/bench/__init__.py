"""Benchmarks behind ``python -m launch.bench``: side-by-side timings in one process."""
