"""The validation-curve keys of ``RUN/metrics.jsonl``: one format, written by training and read
by the reports, the plots and the study.

A validation row holds ``val/<source>`` (the NLL at the training length) and, with
``eval.curve_multipliers``, ``val_<m>x/<source>`` (at m times it).
"""

from __future__ import annotations

# The file a run's metrics rows are appended to, under its workdir.
METRICS_FILE = "metrics.jsonl"


def curve_key(multiplier: int, source: str) -> str:
    """The key of ``source``'s validation NLL at ``multiplier`` x the training length."""
    return f"val/{source}" if multiplier == 1 else f"val_{multiplier}x/{source}"


def parse_curve_key(key: str) -> tuple[int, str] | None:
    """(multiplier, source) of a validation-curve key; None for any other key."""
    head, sep, source = key.partition("/")
    if not sep or not source:
        return None
    if head == "val":
        return 1, source
    if head.startswith("val_") and head.endswith("x") and head[4:-1].isdigit():
        return int(head[4:-1]), source
    return None


def curve_values(row: dict, multiplier: int = 1) -> dict[str, float]:
    """source -> validation NLL of one metrics row at ``multiplier`` x the training length."""
    return {p[1]: v for k, v in row.items() if (p := parse_curve_key(k)) and p[0] == multiplier}


def multipliers(rows: list[dict]) -> list[int]:
    """The lengths beyond the training length (multipliers > 1) that any of ``rows`` holds."""
    return sorted({p[0] for r in rows for k in r if (p := parse_curve_key(k)) and p[0] > 1})
