"""``--coordinator --num-processes --process-id``: a launch command as one process of several where
no scheduler says so (SLURM and TPU pods are detected: fibjax/distributed.py). Kept free of JAX,
so that a command's arguments are checked before JAX starts."""

from __future__ import annotations

import os

_FLAGS = {"coordinator": "FIBJAX_COORDINATOR", "num_processes": "FIBJAX_NUM_PROCESSES", "process_id": "FIBJAX_PROCESS_ID"}


def add_arguments(parser) -> None:
    parser.add_argument("--coordinator", help="host:port of process 0, for multi-process runs without SLURM or a TPU pod (sets FIBJAX_COORDINATOR)")
    parser.add_argument("--num-processes", type=int, help="number of processes in the job (sets FIBJAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, help="this process's index in [0, num-processes) (sets FIBJAX_PROCESS_ID)")


def apply(parser, args) -> None:
    """The flags as FIBJAX_* variables, read by ``fibjax.distributed.initialize``; all three or none."""
    given = {env: getattr(args, name) for name, env in _FLAGS.items() if getattr(args, name) is not None}
    if given and len(given) < len(_FLAGS):
        parser.error("--coordinator, --num-processes and --process-id go together")
    os.environ.update({k: str(v) for k, v in given.items()})
