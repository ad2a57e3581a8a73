"""Metrics as JSON Lines and TensorBoard events, written by process 0 only."""

from __future__ import annotations

import json
from pathlib import Path

import jax


class MetricsWriter:
    def __init__(self, workdir: Path, *, resume_step: int = 0, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = None
        if not self.enabled:
            return
        if self.path.exists():  # drop rows logged after the checkpoint we resume from
            rows = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(r + "\n" for r in rows))
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
