"""Multi-process start-up in one place: one CPU, TPU pod slices, GPU clusters.

``initialize()`` starts JAX's distributed runtime only when the launch environment says this
process is one of several, so the same command runs on a laptop and on a pod. In order:

1. ``FIBJAX_COORDINATOR=host:port``, ``FIBJAX_NUM_PROCESSES``, ``FIBJAX_PROCESS_ID`` (what
   ``--coordinator/--num-processes/--process-id`` of ``launch.train``, ``launch.eval`` and
   ``launch.passkey`` set): explicit.
2. SLURM with more than one task (inside ``srun``): JAX reads the scheduler's variables.
3. A Cloud TPU VM (TPU chips on the PCI bus, or GKE's ``TPU_WORKER_HOSTNAMES``): JAX asks the
   TPU metadata for the workers; run the same command on every worker.

``FIBJAX_DISTRIBUTED=off`` never initialises (e.g. a one-process CPU job on a TPU host); ``=on``
always lets JAX auto-detect (Open MPI, Kubernetes, ...). On CPU the processes' collectives go
over TCP (gloo).

Failures are bounded. Start-up waits at most ``FIBJAX_INIT_TIMEOUT`` seconds (default 300) for
every process to connect, then prints what to check and exits with status 2. Afterwards a
process that sends no heartbeat for ``FIBJAX_HEARTBEAT_TIMEOUT`` seconds (default 100, JAX's)
is declared dead, and JAX's runtime aborts every other process with "another task died" and
"The following tasks are unhealthy (stopped sending heartbeats)", so a job never outlives a
host. A process leaving normally waits at most that long for the others to leave too.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

T = TypeVar("T")
_MESSAGE_BYTES = 4096
_JAX_GRACE_S = 30  # JAX's own connect deadline is later than ours, so ours reports the failure


class DistributedError(RuntimeError):
    """The processes could not start together, or another process failed; the message says which."""


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"{name} must be set (with FIBJAX_COORDINATOR; --num-processes and --process-id set them)")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _on_cloud_tpu_vm() -> bool:
    if os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES"):  # GKE
        return True
    try:  # JAX's own check (TPU chips on the PCI bus); private, so a moved module means "no TPU"
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:
        return False


def launch_mode() -> str:
    """``"explicit"``, ``"auto"`` (JAX detects SLURM / TPU) or ``"single"``."""
    env = os.environ
    switch = env.get("FIBJAX_DISTRIBUTED", "auto")
    if switch not in ("auto", "on", "off"):
        raise DistributedError(f"FIBJAX_DISTRIBUTED must be auto, on or off, got {switch!r}")
    if switch == "off":
        return "single"
    if env.get("FIBJAX_COORDINATOR"):
        return "explicit"
    slurm = all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID"))
    if switch == "on" or (slurm and _env_int("SLURM_NTASKS", 1) > 1) or _on_cloud_tpu_vm():
        return "auto"
    return "single"


def initialize() -> None:
    """Start the JAX distributed runtime if this process is one of several (idempotent)."""
    mode = launch_mode()
    if mode == "single" or jax.distributed.is_initialized():
        return
    kwargs = {}
    where = "the coordinator JAX detected (SLURM or TPU metadata)"
    if mode == "explicit":
        num, pid = _env_int("FIBJAX_NUM_PROCESSES"), _env_int("FIBJAX_PROCESS_ID")
        if not 0 <= pid < num:
            raise DistributedError(f"FIBJAX_PROCESS_ID must lie in [0, FIBJAX_NUM_PROCESSES={num}), got {pid}")
        kwargs = {"coordinator_address": os.environ["FIBJAX_COORDINATOR"], "num_processes": num, "process_id": pid}
        where = f"coordinator {kwargs['coordinator_address']} as process {pid} of {num}"
    init_timeout = _env_int("FIBJAX_INIT_TIMEOUT", 300)
    heartbeat = _env_int("FIBJAX_HEARTBEAT_TIMEOUT", 100)
    failure = (
        f"distributed start-up failed: not every process connected to {where} within FIBJAX_INIT_TIMEOUT="
        f"{init_timeout} s. Start the same command on every host with the same coordinator and process count "
        f"and a distinct process id, and check that the coordinator's host:port is reachable from every host."
    )
    # gloo: CPU processes need a cross-process collective backend (jax < 0.5 had none by default);
    # it only concerns the CPU client, so it is harmless on GPU and TPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A connection timeout inside JAX aborts the process from C++ with "another task died", which
    # misleads; this timer fires first, says what happened, and exits.
    watchdog = threading.Timer(init_timeout, _exit_with, args=(failure,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            **kwargs, initialization_timeout=init_timeout + _JAX_GRACE_S, heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=heartbeat
        )
    except Exception as e:  # bad arguments, or no cluster JAX could detect with FIBJAX_DISTRIBUTED=on
        raise DistributedError(f"{failure} ({type(e).__name__}: {str(e).strip()[:500]})") from e
    finally:
        watchdog.cancel()


def _exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)  # the main thread is blocked in C++; only a hard exit ends the process


def is_main() -> bool:
    return jax.process_index() == 0


def on_main(fn: Callable[[], T], what: str) -> T | None:
    """Run ``fn`` on process 0 only while the others wait; every process raises if it failed.

    The others raise ``DistributedError`` with process 0's message, so a failure there (a bad
    workdir, a missing file) ends every process instead of leaving them in a barrier.
    """
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils

    result, error, message = None, None, b""
    if is_main():
        try:
            result = fn()
        except Exception as e:
            error, message = e, f"{type(e).__name__}: {e}".encode()[:_MESSAGE_BYTES]
    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    buffer[: len(message)] = np.frombuffer(message, np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0").decode(errors="replace")
    if error is not None:
        raise error
    if received:
        raise DistributedError(f"process 0 failed while {what}: {received}")
    return result
