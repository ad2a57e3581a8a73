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


def measure_config(path: str, overrides: list[str], steps: int) -> dict:
    cfg = apply_overrides(load_config_file(path), overrides)
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = step.build(cfg, mesh)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        state = trainer.init()
        batches = [
            jax.device_put(rng.integers(0, cfg.model.vocab_size, (cfg.global_batch, cfg.seq_len + 1), dtype=np.int32), trainer.batch_sharding) for _ in range(2)
        ]
        start = time.perf_counter()
        state, metrics = trainer.step(state, batches[0])
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - start
        times = []
        for i in range(steps):
            start = time.perf_counter()
            state, metrics = trainer.step(state, batches[i % 2])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    s = float(np.median(times))
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    return {
        "config": Path(path).stem,
        "params_M": params / 1e6,
        "seq": cfg.seq_len,
        "batch": cfg.global_batch,
        "devices": mesh.devices.size,
        "s_per_step": s,
        "tokens_per_s": cfg.global_batch * cfg.seq_len / s,
        "first_step_s": compile_s,
    }


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
