"""Dense causal attention by the platform's fused kernel, so that dense-vs-sparse ratios are taken
against the best dense attention a platform has: cuDNN flash attention on GPU (through
``jax.nn.dot_product_attention``), JAX's Pallas flash attention on TPU, the XLA path of
``dense.py`` everywhere else and wherever a kernel's shape rules do not hold.

The choice is made per lowering platform (``jax.lax.platform_dependent``), so one program
lowered for CPU, GPU or TPU takes each platform's branch. Neither fused kernel returns the
log-sum-exp, so calls that need it (the dropped-mass probe) stay on the XLA path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fibjax.attention.common import Array
from fibjax.attention.dense import dense_attention_xla
from fibjax.attention.sharded import per_shard

TPU_BLOCK = 128  # the TPU flash kernel's default query and key block


def fits_cudnn(q: Array) -> bool:
    """cuDNN's flash attention: fp16/bf16, head dim a multiple of 8 up to 128. Outside these,
    jax.nn.dot_product_attention would fall back to an XLA path with [T, T] scores."""
    return q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[3] % 8 == 0 and q.shape[3] <= 128


def fits_tpu_flash(q: Array) -> bool:
    """The TPU kernel tiles the sequence in blocks of 128."""
    return q.shape[1] % TPU_BLOCK == 0


def gpu_attention(q: Array, k: Array, v: Array, implementation: str | None = None) -> Array:
    """[B,T,H,D] x [B,T,K,D] -> [B,T,H,D]; cuDNN where JAX finds it (``implementation=None``),
    GQA and the 1/sqrt(D) scale as every path here."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def tpu_attention(q: Array, k: Array, v: Array) -> Array:
    """JAX's Pallas TPU flash attention on [B,H,T,D] with the KV heads repeated to the query heads
    (the kernel has no GQA), per device shard under a mesh (a Pallas call cannot be partitioned)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    def kernel(q_BTHD, k_BTKD, v_BTKD):
        group = q_BTHD.shape[2] // k_BTKD.shape[2]
        q_BHTD, k_BHTD, v_BHTD = (jnp.swapaxes(jnp.repeat(x, r, axis=2), 1, 2) for x, r in ((q_BTHD, 1), (k_BTKD, group), (v_BTKD, group)))
        out_BHTD = tpu_flash.flash_attention(q_BHTD, k_BHTD, v_BHTD, causal=True, sm_scale=1.0 / math.sqrt(q_BTHD.shape[3]))
        return jnp.swapaxes(out_BHTD, 1, 2)

    return per_shard(kernel, q, k, v, return_lse=False)


def dense_attention_fused(q: Array, k: Array, v: Array) -> Array:
    """Causal attention [B,T,H,D] by the fused kernel of the platform it is lowered for."""
    branches = {}
    if fits_cudnn(q):
        branches["cuda"] = gpu_attention
    if fits_tpu_flash(q):
        branches["tpu"] = tpu_attention
    if not branches:
        return dense_attention_xla(q, k, v)
    return jax.lax.platform_dependent(q, k, v, default=lambda q, k, v: dense_attention_xla(q, k, v), **branches)
