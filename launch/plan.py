"""Size a job before submitting it: ``python -m launch.plan --config CONFIG [--devices N] [key=value ...]``.

Prints per-device bytes of parameters, optimizer state and the train step's working memory for
the config on its mesh (``mesh.data=2 mesh.fsdp=4 mesh.tensor=1`` overrides, as for
launch.train). The step is compiled here for that many simulated CPU devices (no accelerator
needed; --no-compile skips it and prints the exact parameter and optimizer figures only).
Example: ``python -m launch.plan --config configs/ssa/paper_ssa.py mesh.fsdp=8 mesh.data=1``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from launch._args import Parser, parse_with_overrides


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a Python config file with get_config()")
    parser.add_argument("--devices", type=int, default=None, help="the job's devices (default: mesh.devices, else the mesh's product; needed if an axis is -1)")
    parser.add_argument("--no-compile", action="store_true", help="shapes only: skip compiling the step")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, anywhere among the flags, e.g. mesh.fsdp=8 global_batch=64")
    args = parse_with_overrides(parser, argv)

    from fibjax.config import ConfigError, apply_overrides, load_config_file  # no JAX yet
    from fibjax.errors import FibjaxError

    try:
        cfg = apply_overrides(load_config_file(args.config), args.overrides)
        sizes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
        devices = args.devices or cfg.mesh.devices or (math.prod(sizes) if -1 not in sizes else None)
        if devices is None:
            raise ConfigError(f"mesh: {sizes} has an axis of -1: pass --devices N (the job's device count) or mesh.devices=N, or fix every axis")
        if devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {devices}")
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # simulated devices: set before JAX starts (this process plans, it never trains)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()

    import jax

    from fibjax import sharding
    from fibjax.plan import format_plan, make_plan

    if len(jax.devices()) != devices:
        print(f"error: JAX already started with {len(jax.devices())} devices; run launch.plan in its own process", file=sys.stderr)
        return 2
    try:
        mesh = sharding.make_mesh(cfg.mesh)
        if cfg.global_batch % (mesh.shape["data"] * mesh.shape["fsdp"]):
            raise ConfigError(f"global_batch: {cfg.global_batch} is not divisible by data x fsdp = {mesh.shape['data'] * mesh.shape['fsdp']}")
        if not args.no_compile:  # say so first: at paper size this takes minutes and prints nothing else
            print(
                f"compiling {cfg.name}'s training step for {devices} simulated CPU devices to measure its memory "
                "(seconds for a small model, minutes at paper size; --no-compile skips it) ...",
                file=sys.stderr,
                flush=True,
            )
        plan = make_plan(cfg, mesh, compile=not args.no_compile)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(cfg, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
