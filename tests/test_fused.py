"""The platform kernels of dense attention (fibjax/attention/fused.py): each branch against the
oracle on CPU (the GPU branch through jax.nn.dot_product_attention's XLA implementation, the TPU
branch in Pallas' TPU interpret mode), forward and backward, and which branch each platform's
lowering takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from fibjax.attention import dense_attention, fused
from tests import oracle
from tests.tiers import slow

KEY = jax.random.PRNGKey(3)
DTYPES = [jnp.float32, jnp.bfloat16]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _check(fn, q, k, v, dtype):
    t = q.shape[1]
    causal = np.tril(np.ones((t, t), bool))
    assert fn(q, k, v).dtype == dtype
    _close(fn(q, k, v), oracle.masked_attention(q, k, v, causal)[0], oracle.TOL[dtype])
    w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
    got = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w), (0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(oracle.masked_attention(*a, causal)[0] * w), (0, 1, 2))(q, k, v)
    for g, r in zip(got, ref, strict=True):
        _close(g, r, oracle.GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_branch_layout_scale_and_gqa(dtype):
    """The GPU branch's call (layout, scale, GQA, causal) computed by JAX's XLA implementation."""
    q, k, v = oracle.random_qkv(KEY, 2, 64, 4, 2, 16, dtype)
    _check(lambda q, k, v: fused.gpu_attention(q, k, v, implementation="xla"), q, k, v, dtype)


@slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_tpu_branch_in_interpret_mode(dtype):
    q, k, v = oracle.random_qkv(KEY, 1, 256, 4, 2, 64, dtype)
    with pltpu.force_tpu_interpret_mode():
        _check(fused.tpu_attention, q, k, v, dtype)


def _lowered(platform, q, **kw):
    k = jax.ShapeDtypeStruct(q.shape[:2] + (2, q.shape[3]), q.dtype)
    return jax.jit(lambda q, k, v: dense_attention(q, k, v, **kw)).trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()


def test_each_platform_lowers_its_branch():
    """TPU: the Pallas kernel's custom call where T is a multiple of 128. GPU: there is no GPU
    here, so JAX finds no cuDNN and lowers jax.nn.dot_product_attention's own XLA fallback, whose
    two matmuls ([T, T] scores) tell it apart from fibjax's XLA path (at T = 1024 two query chunks
    of 512 over key tiles: the first chunk's masked loop, the second's unmasked and masked loops,
    two matmuls each)."""
    bf16 = jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.bfloat16)
    assert "tpu_custom_call" in _lowered("tpu", bf16)
    assert "tpu_custom_call" not in _lowered("tpu", jax.ShapeDtypeStruct((2, 1000, 8, 64), jnp.bfloat16))  # not a multiple of 128
    assert "tpu_custom_call" not in _lowered("tpu", bf16, implementation="xla")
    xla_dots = _lowered("cpu", bf16).count("dot_general")
    assert xla_dots == 6 and _lowered("cuda", bf16, implementation="xla").count("dot_general") == xla_dots
    assert _lowered("cuda", bf16).count("dot_general") == 2
    assert _lowered("cuda", jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.float32)).count("dot_general") == xla_dots  # no fp32 flash in cuDNN
    assert _lowered("cuda", bf16, return_lse=True).count("dot_general") == xla_dots  # neither kernel returns the log-sum-exp


def test_cpu_numbers_are_the_xla_paths_and_arguments_are_checked():
    q, k, v = oracle.random_qkv(KEY, 1, 256, 4, 2, 32, jnp.bfloat16)
    np.testing.assert_array_equal(dense_attention(q, k, v), dense_attention(q, k, v, implementation="xla"))
    with pytest.raises(ValueError, match="implementation must be one of"):
        dense_attention(q, k, v, implementation="cudnn")
