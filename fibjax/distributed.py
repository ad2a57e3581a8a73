"""Multi-process start-up in one place: single CPU, TPU pod slices, GPU clusters.

``initialize()`` calls ``jax.distributed.initialize`` only when the launch environment asks
for it, so the same command runs on one machine and on a pod.
"""

from __future__ import annotations

import os

import jax


def requested() -> bool:
    env = os.environ
    return bool(env.get("FIBJAX_COORDINATOR") or env.get("JAX_COORDINATOR_ADDRESS") or int(env.get("SLURM_NTASKS", "1")) > 1 or env.get("TPU_WORKER_HOSTNAMES"))


def initialize() -> None:
    """Start the JAX distributed runtime if this process is one of several."""
    if not requested() or jax.distributed.is_initialized():
        return
    env = os.environ
    if env.get("FIBJAX_COORDINATOR"):
        jax.distributed.initialize(
            coordinator_address=env["FIBJAX_COORDINATOR"],
            num_processes=int(env["FIBJAX_NUM_PROCESSES"]),
            process_id=int(env["FIBJAX_PROCESS_ID"]),
        )
    else:  # JAX auto-detects SLURM, TPU pods and JAX_COORDINATOR_ADDRESS
        jax.distributed.initialize()


def is_main() -> bool:
    return jax.process_index() == 0
