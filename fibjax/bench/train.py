"""``python -m launch.bench train``: train-step throughput of configs, side by side.

Synthetic token batches (no data reading), the real jitted step on the real mesh: the number
is the model's training throughput on this machine, comparable across configs in one run.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from fibjax import sharding
from fibjax.config import apply_overrides, load_config_file
from fibjax.train import step


class _Run:
    """One config's compiled training step on synthetic batches, ready to be timed."""

    def __init__(self, path: str, overrides: list[str]):
        self.cfg = cfg = apply_overrides(load_config_file(path), overrides)
        self.path = path
        self.mesh = sharding.make_mesh(cfg.mesh)
        self.trainer = step.build(cfg, self.mesh)
        rng = np.random.default_rng(0)
        with jax.set_mesh(self.mesh):
            self.state = self.trainer.init()
            shape = (cfg.global_batch, cfg.seq_len + 1)
            self.batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), self.trainer.batch_sharding) for _ in range(2)]
        self.compile_s = self.time(1)[0]
        self.times: list[float] = []

    def time(self, steps: int) -> list[float]:
        out = []
        with jax.set_mesh(self.mesh):
            for i in range(steps):
                start = time.perf_counter()
                self.state, metrics = self.trainer.step(self.state, self.batches[i % 2])
                jax.block_until_ready(metrics)
                out.append(time.perf_counter() - start)
        return out

    def row(self) -> dict:
        s = float(np.median(self.times))
        return {
            "config": Path(self.path).stem,
            "params_M": sum(x.size for x in jax.tree.leaves(self.state["params"])) / 1e6,
            "seq": self.cfg.seq_len,
            "batch": self.cfg.global_batch,
            "devices": self.mesh.devices.size,
            "s_per_step": s,
            "tokens_per_s": self.cfg.global_batch * self.cfg.seq_len / s,
            "first_step_s": self.compile_s,
        }


def measure(paths: list[str], overrides: list[str], steps: int, rounds: int = 1) -> list[dict]:
    """Each config's median step time: all compiled first, then ``rounds`` rounds that time
    ``steps`` steps of each config in turn, so load from other jobs falls on every config alike."""
    runs = [_Run(p, overrides) for p in paths]
    for _ in range(rounds):
        for r in runs:
            r.times += r.time(steps)
    return [r.row() for r in runs]


def measure_config(path: str, overrides: list[str], steps: int) -> dict:
    """One config alone (``measure`` with one path and one round)."""
    return measure([path], overrides, steps)[0]


def table(rows: list[dict]) -> str:
    base = rows[0]["tokens_per_s"]
    lines = [
        "| config | params (M) | seq x batch | devices | s/step (median) | tokens/s | vs first | first step (compile) s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['params_M']:.2f} | {r['seq']}x{r['batch']} | {r['devices']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base:.2f} | {r['first_step_s']:.1f} |"
        )
    return "\n".join(lines)
