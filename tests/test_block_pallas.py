"""The Pallas block-sparse kernels (interpret mode on CPU: forward, dq, dk/dv) against the
loop-and-mask reference (tests/block_oracle.py), forward, lse and gradients; the dk/dv kernel's
inverse map against a plain count, and its TPU layout (scalar prefetch) against its GPU one. Their
lowering for GPU and TPU is in tests/test_pallas.py beside the offset kernels'.

Dyadic inputs (selections exact, ties included) and the oracle's per-dtype tolerances: output
and lse fp32 2e-5, bf16 3e-2; gradients fp32 1e-4, bf16 8e-2. Each comparison is one program
compiled at -O0 (interpret-mode kernels are large XLA programs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fibjax.attention.pallas import BlockSizes, block_bwd
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from tests import block_oracle as bo
from tests.tiers import first_fast

jit_o0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# (batch, T, q heads, kv heads, head dim, block, S, rows per program, pairs per dk/dv tile): a
# ragged tail over several programs with GQA (G = 3), MHA with S above the block count, one
# program with G = 2, a sequence shorter than one block
CASES = [(2, 45, 6, 2, 8, 4, 3, 16, 8), (1, 40, 2, 2, 4, 8, 9, 8, 4), (1, 64, 4, 2, 16, 8, 4, 64, 64), (1, 5, 2, 1, 4, 8, 2, 8, 8)]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _check_against_oracle(q, k, v, dtype, block, s, block_sizes):
    w_out, w_lse = (jax.random.normal(key, shape) for key, shape in zip(jax.random.split(jax.random.PRNGKey(1)), (q.shape, q.shape[:3])))
    chosen = bo.selected_blocks(q, k, block, s)  # the choice has no gradient

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), (out, lse)

    kernel = lambda q, k, v: block_sparse_attention_pallas(q, k, v, block_size=block, num_blocks=s, return_lse=True, block_sizes=block_sizes)
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
    return chosen


@pytest.mark.parametrize("dtype", first_fast([jnp.float32, jnp.bfloat16]))
@pytest.mark.parametrize("case", first_fast(CASES))
def test_kernel_matches_oracle_forward_and_backward(case, dtype):
    b, t, h, kh, d, block, s, rows, pairs = case
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), b, t, h, kh, d, dtype)
    _check_against_oracle(q, k, v, dtype, block, s, BlockSizes(rows, pairs))


@pytest.mark.parametrize("dtype", first_fast([jnp.float32, jnp.bfloat16]))
def test_block_chosen_by_every_query_spans_many_tiles(dtype):
    """Block 0's keys are all 3 and every q is positive, so every later query chooses block 0:
    60 pairs of one block in tiles of 8 (dk/dv summed over 8 programs' partials)."""
    t, block, pairs = 64, 4, 8
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(2), 1, t, 4, 2, 8, dtype)
    q, k = jnp.abs(q) + 0.125, k.at[:, :block].set(3)
    chosen = _check_against_oracle(q, k, v, dtype, block, 3, BlockSizes(16, pairs))
    assert np.all(chosen[0, :, :, 0].sum(axis=0) == t) and t > 4 * pairs


def test_inverse_map_holds_every_pair_once():
    """``tiles_of`` against a plain count: each tile's first ``count`` rows are the queries that
    chose its block (every (query, block) pair exactly once), the rest empty (T); blocks sorted."""
    b, kh, t, s, n, r = 2, 2, 24, 3, 6, 4
    blocks = jax.random.randint(jax.random.PRNGKey(3), (b, kh, t, s), -1, n)
    tiles = block_bwd.tiles_of(blocks, n, r)
    rows = np.asarray(tiles.rows).reshape(b * kh, -1, r)
    tile_blocks, counts = (np.asarray(x).reshape(b * kh, -1) for x in (tiles.blocks, tiles.counts))
    for head, idx_TS in enumerate(np.asarray(blocks).reshape(b * kh, t, s)):
        want = sorted((int(q), int(m)) for q, m in zip(*np.nonzero(idx_TS >= 0)[:1], idx_TS[idx_TS >= 0]))
        got = sorted((int(q), int(m)) for x, m in enumerate(tile_blocks[head]) for q in rows[head, x, : counts[head, x]])
        assert got == want
        assert np.all(rows[head][np.arange(r)[None, :] >= counts[head][:, None]] == t)
        assert np.all(np.diff(tile_blocks[head]) >= 0) and np.all(counts[head] <= r)


def test_tpu_layout_matches_gpu_layout():
    """The dk/dv kernel with its tile scalars scalar-prefetched and the K/V block chosen by the
    index map (TPU) gives what it gives reading them as arrays and slicing whole K/V (GPU)."""
    b, kh, g, t, d, block, n, r = 1, 2, 2, 16, 8, 4, 4, 4
    ks = jax.random.split(jax.random.PRNGKey(4), 7)
    q, do = (jax.random.normal(kk, (b, kh, g, t, d)) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (b, kh, t, d)) for kk in ks[2:4])
    lse, delta = (jax.random.normal(kk, (b, kh, g, t)) for kk in ks[4:6])
    own = jnp.broadcast_to((jnp.arange(t) // block)[:, None], (b, kh, t, 1))
    blocks = jnp.concatenate([own, jax.random.randint(ks[6], (b, kh, t, 2), -1, n)], axis=-1)
    tiles = block_bwd.tiles_of(blocks, n, r)
    call = functools.partial(block_bwd.dkdv_partials, q, k, v, do, lse, delta, tiles, block=block, backend="interpret", block_sizes=BlockSizes(8, r))
    for tpu, gpu in zip(call(prefetch=True), call(prefetch=False)):
        assert np.any(np.asarray(gpu) != 0)
        np.testing.assert_allclose(np.asarray(tpu), np.asarray(gpu), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("backend", "heads", "head_dim", "block", "problem"),
    [("triton", 6, 8, 16, "heads per KV head"), ("triton", 4, 12, 16, "head_dim"), ("triton", 4, 8, 12, "block_size"), ("mosaic_tpu", 4, 8, 12, "block_size")],
)
def test_shapes_a_compiler_rejects_are_named(backend, heads, head_dim, block, problem):
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), 1, 64, heads, 2, head_dim)
    with pytest.raises(ValueError, match=problem):
        block_sparse_attention_pallas(q, k, v, block_size=block, num_blocks=2, backend=backend)


def test_the_public_function_and_the_model_reach_the_kernels_with_implementation_pallas(monkeypatch):
    """``implementation="pallas"`` (the function's argument, ``model.attention.implementation``)
    runs the kernels, and the model's logits equal its XLA logits."""
    from flax import nnx

    from fibjax.attention import api
    from fibjax.config import AttentionConfig, ModelConfig
    from fibjax.model import Transformer

    calls = []
    kernel = api.block_sparse_attention_pallas
    monkeypatch.setattr(api, "block_sparse_attention_pallas", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(3), 1, 24, 4, 2, 8, jnp.float32)
    got = api.block_sparse_attention(q, k, v, block_size=4, num_blocks=2, implementation="pallas")
    _close(got, api.block_sparse_attention(q, k, v, block_size=4, num_blocks=2, implementation="xla"), bo.TOL[jnp.float32])
    assert len(calls) == 1 and calls[0]["block_size"] == 4 and calls[0]["num_blocks"] == 2

    def logits(impl):
        attention = AttentionConfig(kind="block_sparse", block_size=4, num_blocks=2, implementation=impl)
        cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, attention=attention)
        return Transformer(cfg, rngs=nnx.Rngs(0))(jnp.arange(20)[None] % 64)

    _close(logits("pallas"), logits("xla"), bo.TOL[jnp.float32])
    assert len(calls) == 3  # one call per layer
