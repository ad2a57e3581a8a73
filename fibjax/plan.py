"""Size a training job before submitting it: per-device bytes of parameters, optimizer state and
the step's working memory, for a config on a mesh.

Parameters and optimizer state come from shapes and shardings (exact: the logical-axis rules of
``fibjax.sharding`` applied to every leaf). The working memory (activations kept for the
backward, temporaries) comes from XLA's memory analysis of the train step compiled here for
that many simulated CPU devices: the same partitioning as on the fleet, but the CPU compiler's
fusion and scheduling, so read it as an estimate of a GPU/TPU program's figure, not a bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.config import TrainConfig
from fibjax.train.step import Trainer, build


@dataclass
class Plan:
    mesh: dict[str, int]
    params: int  # bytes per device
    opt_state: int
    batch_rows: int  # rows of the global batch each device holds
    compiled: dict[str, int] | None  # XLA memory analysis per device (None: not compiled)
    compile_s: float | None

    @property
    def total(self) -> int | None:
        """Peak estimate per device: arguments (state, batch) + temporaries + outputs not aliased."""
        if self.compiled is None:
            return None
        c = self.compiled
        return c["argument"] + c["temp"] + max(c["output"] - c["alias"], 0)


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs carrying NamedShardings (the
    largest shard, when a dimension does not split evenly)."""
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def batch_struct(trainer: Trainer) -> jax.ShapeDtypeStruct:
    cfg = trainer.cfg
    return jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len + 1), jnp.int32, sharding=trainer.batch_sharding)


def make_plan(cfg: TrainConfig, mesh: jax.sharding.Mesh, *, compile: bool = True) -> Plan:
    trainer = build(cfg, mesh)
    state = trainer.abstract_state
    rows = batch_struct(trainer).sharding.shard_shape((cfg.global_batch, cfg.seq_len + 1))[0]
    compiled, seconds = None, None
    if compile:
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            program = trainer.step.lower(state, batch_struct(trainer)).compile()
        seconds = time.perf_counter() - start
        m = program.memory_analysis()
        compiled = {
            "argument": m.argument_size_in_bytes,
            "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes,
            "temp": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes,
        }
    return Plan(dict(mesh.shape), per_device_bytes(state["params"]), per_device_bytes(state["opt_state"]), rows, compiled, seconds)


def gib(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_plan(cfg: TrainConfig, plan: Plan) -> str:
    mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
    lines = [
        f"{cfg.name}: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}, "
        f"seq_len {cfg.seq_len}, global batch {cfg.global_batch}, attention {cfg.model.attention.kind}, "
        f"remat {cfg.model.remat}, logits_chunk {cfg.model.logits_chunk}",
        f"mesh: {mesh} ({math.prod(plan.mesh.values())} devices); {plan.batch_rows} batch rows per device",
        "| per device | bytes |",
        "|---|---:|",
        f"| parameters | {gib(plan.params)} |",
        f"| optimizer state | {gib(plan.opt_state)} |",
    ]
    if plan.compiled:
        c = plan.compiled
        lines += [
            f"| step arguments (state + batch) | {gib(c['argument'])} |",
            f"| step temporaries (activations, gradients, workspace) | {gib(c['temp'])} |",
            f"| step outputs not donated | {gib(max(c['output'] - c['alias'], 0))} |",
            f"| **peak estimate** | **{gib(plan.total)}** |",
            f"compiled for {math.prod(plan.mesh.values())} simulated CPU devices in {plan.compile_s:.1f} s "
            "(XLA's CPU memory analysis: an estimate of the accelerator program's)",
        ]
    else:
        lines.append("not compiled (--no-compile): parameters and optimizer state only")
    return "\n".join(lines)
