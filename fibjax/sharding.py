"""Sharding is data: model code names logical axes, this one table maps them to mesh axes.

Parameters carry ``logical_axes`` metadata (see ``fibjax.model``); a dimension whose size the
mesh axis does not divide is replicated instead (so tiny test models shard what they can).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fibjax.attention.sharded import BATCH_AXES, HEAD_AXIS
from fibjax.config import ConfigError, MeshConfig

MESH_AXES = (*BATCH_AXES, HEAD_AXIS)  # ("data", "fsdp", "tensor"), shared with attention.sharded

# logical axis -> mesh axis (None = replicated)
RULES: dict[str, str | None] = {"vocab": HEAD_AXIS, "embed": "fsdp", "heads": HEAD_AXIS, "kv_heads": HEAD_AXIS, "mlp": HEAD_AXIS}


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Resolve -1 to the devices left over; the product must equal ``num_devices``."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ConfigError(f"mesh: {num_devices} devices cannot be split with fixed axes {sizes}")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"mesh: data x fsdp x tensor = {sizes} uses {math.prod(sizes)} devices, but {num_devices} are available")
    return tuple(sizes)


def job_devices(cfg: MeshConfig) -> list:
    """The devices a mesh of ``cfg`` takes: every device of the job, or its first ``cfg.devices``."""
    devices = jax.devices()
    if not cfg.devices:
        return devices
    if jax.process_count() > 1:
        raise ConfigError(f"mesh.devices={cfg.devices}: a job of {jax.process_count()} processes uses every device (mesh.devices=0)")
    if cfg.devices > len(devices):
        raise ConfigError(f"mesh.devices={cfg.devices}, but {len(devices)} devices are available")
    return devices[: cfg.devices]


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    # Auto axes: Explicit ones (jax.make_mesh's default) break NNX embedding lookups (PLATFORM.md).
    devices = job_devices(cfg) if devices is None else devices
    try:
        shape = mesh_shape(cfg, len(devices))
    except ConfigError as e:
        if not cfg.devices:
            raise
        raise ConfigError(f"{e} (mesh.devices={cfg.devices} of {len(jax.devices())})") from None
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _spec(logical_axes, shape, mesh: Mesh) -> PartitionSpec:
    axes = []
    for name, dim in zip(logical_axes or (), shape):
        mesh_axis = RULES.get(name) if name else None
        axes.append(mesh_axis if mesh_axis and dim % mesh.shape[mesh_axis] == 0 else None)
    return PartitionSpec(*axes)


def param_shardings(abstract_params: nnx.State, mesh: Mesh):
    """Pure dict of NamedSharding, one per parameter, from its logical axes."""

    def one(var):
        return NamedSharding(mesh, _spec(var.get_metadata().get("logical_axes"), var.shape, mesh))

    return nnx.to_pure_dict(jax.tree.map(one, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
