"""The Pallas block-sparse kernel (interpret mode on CPU) against the loop-and-mask reference
(tests/block_oracle.py), forward, lse and gradients; its lowering for GPU and TPU is in
tests/test_pallas.py beside the offset kernels'.

Dyadic inputs (selections exact, ties included) and the oracle's per-dtype tolerances: output
and lse fp32 2e-5, bf16 3e-2; gradients fp32 1e-4, bf16 8e-2. Each comparison is one program
compiled at -O0 (interpret-mode kernels are large XLA programs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fibjax.attention.pallas import BlockSizes
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from tests import block_oracle as bo
from tests.tiers import first_fast

jit_o0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# (batch, T, q heads, kv heads, head dim, block, S, rows per program): a ragged tail over several
# programs with GQA (G = 3), MHA with S above the block count, one program with G = 2
CASES = [(2, 45, 6, 2, 8, 4, 3, 16), (1, 40, 2, 2, 4, 8, 9, 8), (1, 64, 4, 2, 16, 8, 4, 64)]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


@pytest.mark.parametrize("dtype", first_fast([jnp.float32, jnp.bfloat16]))
@pytest.mark.parametrize("case", first_fast(CASES))
def test_kernel_matches_oracle_forward_and_backward(case, dtype):
    b, t, h, kh, d, block, s, rows = case
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), b, t, h, kh, d, dtype)
    w_out, w_lse = (jax.random.normal(key, shape) for key, shape in zip(jax.random.split(jax.random.PRNGKey(1)), (q.shape, q.shape[:3])))
    chosen = bo.selected_blocks(q, k, block, s)  # the choice has no gradient

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), (out, lse)

    kernel = lambda q, k, v: block_sparse_attention_pallas(q, k, v, block_size=block, num_blocks=s, return_lse=True, block_sizes=BlockSizes(rows, rows))
    reference = lambda q, k, v: bo.block_sparse_reference(q, k, v, block, s, chosen)

    @jit_o0
    def both(q, k, v):
        return [jax.grad(functools.partial(loss, fn), (0, 1, 2), has_aux=True)(q, k, v) for fn in (kernel, reference)]

    (grads, (out, lse)), (ref_grads, (ref, ref_lse)) = both(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    _close(out, ref, bo.TOL[dtype])
    _close(lse, ref_lse, bo.TOL[dtype])
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        _close(g, r, bo.GRAD_TOL[dtype])
