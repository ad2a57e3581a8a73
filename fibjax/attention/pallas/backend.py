"""Block sizes and the per-backend pieces of a ``pallas_call`` (the one place that knows them).

A kernel here runs three ways: ``"interpret"`` (any machine, CPU included: the kernel body
runs as an XLA program), ``"triton"`` (Pallas' Triton lowering for NVIDIA GPUs) and
``"mosaic_tpu"``. The kernel bodies are shared; only compiler parameters, where per-rung
scalars live, and the grid semantics differ, and those are built here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

Backend = Literal["interpret", "triton", "mosaic_tpu"]
BACKENDS: tuple[str, ...] = ("interpret", "triton", "mosaic_tpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per program: ``block_q`` queries (forward, dq), ``block_k`` keys (dk/dv).

    Both must be powers of two (Triton loads only power-of-two shapes); they shrink to the
    next power of two >= the sequence length for short inputs, so a 40-token call pads to 64,
    not 128. On TPU they should stay multiples of 128 (the lane width of the LSE blocks).
    ``num_warps`` and ``num_stages`` go to Triton only.
    """

    block_q: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if b < 1 or b & (b - 1):
                raise ValueError(f"{name} must be a power of two, got {b}")

    def fit(self, seq_len: int) -> BlockSizes:
        cap = 1 << max(seq_len - 1, 0).bit_length()
        return dataclasses.replace(self, block_q=min(self.block_q, cap), block_k=min(self.block_k, cap))


def default_backend() -> Backend:
    """The backend for the default JAX platform: interpret on CPU (the only way Pallas runs there)."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "mosaic_tpu"
    if platform in ("gpu", "cuda"):
        return "triton"
    return "interpret"


def resolve(backend: str | None) -> Backend:
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
    return backend


def scalar_spec(backend: Backend) -> pl.BlockSpec:
    """The whole per-rung vector (lo or frac), read one scalar at a time.

    Mosaic reads scalars only from SMEM; Triton and the interpreter read them from the array.
    """
    if backend == "mosaic_tpu":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(memory_space=None)


def call(kernel, *, backend: Backend, block_sizes: BlockSizes, grid, in_specs, out_specs, out_shape, name: str, scalar_prefetch: int = 0):
    """``pl.pallas_call`` with the backend's compiler parameters; every grid axis is independent.

    ``scalar_prefetch``: the first that many operands are scalar-prefetched (Mosaic's
    ``PrefetchScalarGridSpec``: whole arrays in SMEM before the grid runs, passed to the kernel
    first and to every index map after the grid indices, so a block's index can be data). The
    interpreter runs it too; Triton has no scalar prefetch."""
    params = None
    if backend == "triton":
        params = pltriton.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages)
    elif backend == "mosaic_tpu":
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))
    specs = dict(grid=grid, in_specs=in_specs, out_specs=out_specs)
    if scalar_prefetch:
        if backend == "triton":
            raise ValueError("Pallas' Triton backend has no scalar prefetch")
        specs = dict(grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=scalar_prefetch, **specs))
    return pl.pallas_call(kernel, **specs, out_shape=out_shape, compiler_params=params, interpret=backend == "interpret", name=name)


IMPLEMENTATIONS = (None, "xla", "pallas")
# Platforms on which ``implementation=None`` picks the kernels. A platform joins only once its
# hardware check (launch/gpu_check.sh for GPUs) has passed there and its table is in
# BUILD_NOTES.md. None has yet: the kernels are lowered for Triton and Mosaic in the tests but
# have never been compiled or run on a GPU or TPU, so the default is the XLA path everywhere,
# and ``implementation="pallas"`` (config: model.attention.implementation=pallas) opts in.
PALLAS_BY_DEFAULT: frozenset[str] = frozenset()


def use_pallas(implementation: str | None) -> bool:
    """The dispatch rule of the public API: "pallas" / "xla" force one; None picks Pallas only on
    a platform in PALLAS_BY_DEFAULT (none yet), else XLA."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation is None:
        return jax.default_backend() in PALLAS_BY_DEFAULT
    return implementation == "pallas"
