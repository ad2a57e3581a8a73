"""Block-sparse attention against the loop-and-mask reference (tests/block_oracle.py).

Inputs are dyadic (multiples of 1/8, tests/block_oracle.dyadic_qkv): every selection score is
then exact in float32 and in the float64 loops, so the selections must agree exactly, ties
included. Outputs, lse and gradients use the same per-dtype tolerances as the other paths
(tests/oracle.py: fp32 2e-5 / grads 1e-4; bf16 3e-2 / grads 8e-2).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibjax.attention import block_sparse_attention, dense_attention
from fibjax.attention.block_sparse import _chosen_blocks, block_sparse_attention_xla, dropped_mass, select_blocks
from tests import block_oracle as bo
from tests.tiers import slow

KEY = jax.random.PRNGKey(0)
DTYPES = [jnp.float32, jnp.bfloat16]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "query_chunk"))
def _grads(q, k, v, w, *, block_size, num_blocks, query_chunk=512):
    attend = functools.partial(block_sparse_attention_xla, block_size=block_size, num_blocks=num_blocks, query_chunk=query_chunk)
    f = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)
    return jax.grad(f, (0, 1, 2))(q, k, v)


def _reference_grads(q, k, v, w, block_size, num_blocks):
    chosen = bo.selected_blocks(q, k, block_size, num_blocks)  # selection has no gradient
    f = lambda q, k, v: jnp.sum(bo.block_sparse_reference(q, k, v, block_size, num_blocks, chosen)[0] * w)
    return jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)


# (batch, T, q heads, kv heads, head dim, block, S): ragged tails, GQA, MHA, S above and below N
SHAPE = (2, 45, 6, 2, 8)  # the shape most tests share, so compiled programs are reused
CASES = [(*SHAPE, 4, 3), (1, 64, 4, 1, 16, 8, 4), (2, 33, 2, 2, 4, 5, 2), (1, 70, 4, 2, 8, 3, 6)]


@pytest.mark.parametrize("case", CASES)
def test_selection_matches_oracle_and_is_ordered(case):
    b, t, h, kh, d, block, s = case
    q, k, _ = bo.dyadic_qkv(KEY, b, t, h, kh, d)
    idx = np.asarray(select_blocks(q, k, block_size=block, num_blocks=s))
    n = -(-t // block)
    assert idx.shape == (b, t, kh, min(s, n)) and idx.dtype == np.int32
    np.testing.assert_array_equal(bo.indices_to_blocks(idx, n), bo.selected_blocks(q, k, block, s))
    assert np.all(idx[..., 0] == (np.arange(t) // block)[None, :, None])  # slot 0: own block
    scores = bo.selection_scores(q, k, block)
    for bi, i, kv in np.ndindex(b, t, kh):
        rest = idx[bi, i, kv, 1:]
        filled = rest[rest >= 0]
        assert np.all(rest[len(filled) :] == -1)  # empty slots only at the end
        assert len(filled) == min(s - 1, i // block)
        sc = scores[bi, i, kv, filled]
        assert np.all((sc[:-1] > sc[1:]) | ((sc[:-1] == sc[1:]) & (filled[:-1] < filled[1:])))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_oracle(dtype, case):
    b, t, h, kh, d, block, s = case
    q, k, v = bo.dyadic_qkv(KEY, b, t, h, kh, d, dtype)
    out, lse = block_sparse_attention(q, k, v, block_size=block, num_blocks=s, return_lse=True)
    ref, ref_lse = bo.block_sparse_reference(q, k, v, block, s)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    _close(out, ref, bo.TOL[dtype])
    _close(lse, ref_lse, bo.TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[:2])
def test_gradients_match_oracle(dtype, case):
    b, t, h, kh, d, block, s = case
    q, k, v = bo.dyadic_qkv(KEY, b, t, h, kh, d, dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
    got = _grads(q, k, v, w, block_size=block, num_blocks=s)
    ref = _reference_grads(q, k, v, w, block, s)
    for g, r in zip(got, ref):
        assert g.dtype == dtype
        _close(g, r, bo.GRAD_TOL[dtype])


def test_scores_far_above_the_own_block_take_the_exact_two_pass_forward():
    """The forward exponentiates against each query's own-block maximum; here an earlier block
    scores ~700 above it, so that sum overflows float32 and the two-pass forward must take over
    (removing the fallback fails this test: NaN)."""
    q, k, v = bo.dyadic_qkv(KEY, 1, 32, 2, 1, 8)
    q, k = jnp.full_like(q, 24.0), k.at[:, 4:].set(-3.0).at[:, :4].set(8.0)
    scores = np.asarray(bo.selection_scores(q, k, 4))  # q . mean(K_b), unscaled
    assert (scores[0, 8:, 0, 0] - scores[0, 8:, 0, 1]).min() / np.sqrt(8) > 88 * 2  # past e^88 for both heads
    out, lse = block_sparse_attention(q, k, v, block_size=4, num_blocks=2, return_lse=True)
    ref, ref_lse = bo.block_sparse_reference(q, k, v, 4, 2)
    assert np.all(np.isfinite(np.asarray(out)))
    _close(out, ref, bo.TOL[jnp.float32])
    _close(lse, ref_lse, bo.TOL[jnp.float32])
    w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    for g, r in zip(_grads(q, k, v, w, block_size=4, num_blocks=2), _reference_grads(q, k, v, w, 4, 2)):
        _close(g, r, bo.GRAD_TOL[jnp.float32])


def test_query_chunks_change_nothing():
    """The lax.map path (several chunks, ragged padding) equals one chunk, forward and backward."""
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    w = jax.random.normal(jax.random.PRNGKey(2), q.shape)
    one = block_sparse_attention_xla(q, k, v, block_size=4, num_blocks=3, return_lse=True)
    for chunk in (4, 12):  # 12 chunks; 4 chunks over a padded tail
        many = block_sparse_attention_xla(q, k, v, block_size=4, num_blocks=3, return_lse=True, query_chunk=chunk)
        for a, r in zip(many, one):
            _close(a, r, bo.TOL[jnp.float32])
        for a, r in zip(_grads(q, k, v, w, block_size=4, num_blocks=3, query_chunk=chunk), _grads(q, k, v, w, block_size=4, num_blocks=3)):
            _close(a, r, bo.GRAD_TOL[jnp.float32])


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value a jaxpr (and the jaxprs inside it: map, scan, cond) makes."""
    most = 0
    for eqn in jaxpr.eqns:
        most = max([most, *(int(np.prod(v.aval.shape)) for v in eqn.outvars)])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            most = max(most, _largest_intermediate(sub))
    return most


def test_the_choice_never_holds_the_whole_score_matrix():
    """The choice (``_chosen_blocks``, which both the XLA and the Pallas path run) scores a chunk of
    256 queries at a time: at 4,096 queries and 256 blocks no value it makes is a quarter of the
    [T, T/B] scores (one chunk's are 1/16)."""
    t, block = 4096, 16
    q, k = jnp.zeros((1, t, 1, 8)), jnp.zeros((1, t, 1, 8))
    choose = functools.partial(_chosen_blocks, block=block, top=15, rule="mean_key", chunk=256)
    jaxpr = jax.make_jaxpr(lambda q, k: choose(q, k, None))(q, k).jaxpr
    assert _largest_intermediate(jaxpr) < t * (t // block) // 4


def test_one_block_is_own_block_only():
    """S = 1: block-diagonal causal attention; with B = 1 every query sees only itself."""
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    t = q.shape[1]
    idx = np.asarray(select_blocks(q, k, block_size=6, num_blocks=1))
    assert idx.shape[-1] == 1 and np.all(idx[..., 0] == (np.arange(t) // 6)[None, :, None])
    own = np.zeros((2, t, 2, 8), bool)
    own[:, np.arange(t), :, np.arange(t) // 6] = True
    ref, _ = bo.block_sparse_reference(q, k, v, 6, 1, chosen=own)
    _close(block_sparse_attention(q, k, v, block_size=6, num_blocks=1), ref, bo.TOL[jnp.float32])
    _close(block_sparse_attention(q, k, v, block_size=1, num_blocks=1), jnp.repeat(v, 3, axis=2), bo.TOL[jnp.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_enough_blocks_is_dense(dtype):
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE, dtype)
    ref, ref_lse = dense_attention(q, k, v, return_lse=True)
    for block, s in ((4, 12), (64, 1), (1, 45)):  # S = N exactly; one block past T; B = 1, S = T
        out, lse = block_sparse_attention(q, k, v, block_size=block, num_blocks=s, return_lse=True)
        _close(out, ref, bo.TOL[dtype])
        _close(lse, ref_lse, bo.TOL[dtype])


def test_ties_go_to_the_lower_block():
    t, block = SHAPE[1], 4  # 12 blocks
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    # every full block equal: all scores tie, so query block c keeps blocks 0 .. S-2
    k = jnp.tile(k[:, :block], (1, 12, 1, 1))[:, :t]
    idx = np.asarray(select_blocks(q, k, block_size=block, num_blocks=3))
    for i in range(t):
        c = i // block
        assert np.all(idx[:, i] == [c, *range(min(2, c)), *[-1] * (2 - min(2, c))])
    # two equal best blocks (1 and 3) and a worse one (2): S = 3 keeps block 1 and one of 0/2
    k = np.zeros(k.shape, np.float32)
    k[:, 4:8], k[:, 12:16], k[:, 8:12], k[:, 16:] = 1.0, 1.0, 0.5, -1.0
    q = jnp.ones(q.shape)
    idx = np.asarray(select_blocks(q, k, block_size=block, num_blocks=3))
    assert np.all(idx[:, 16:, :, 1:] == [1, 3]) and np.all(idx[:, 12:16, :, 1:] == [1, 2])
    out = block_sparse_attention(q, k, v, block_size=block, num_blocks=3)
    ref, _ = bo.block_sparse_reference(q, k, v, block, 3)
    _close(out, ref, bo.TOL[jnp.float32])


def test_selection_is_per_kv_head_over_the_group_sum():
    """Two query heads of one group: the group's summed score decides, not either head alone."""
    t, block = 12, 4
    q = jnp.zeros((1, t, 2, 2)).at[:, :, 0, 0].set(1.0).at[:, :, 1, 1].set(3.0)
    k = jnp.zeros((1, t, 1, 2)).at[:, 0:4, 0, 0].set(2.0).at[:, 4:8, 0, 1].set(1.0)
    # head 0 alone prefers block 0 (2 vs 0), head 1 alone block 1 (0 vs 3); the sum: 2 vs 3
    idx = np.asarray(select_blocks(q, k, block_size=block, num_blocks=2))
    assert np.all(idx[0, 8:, 0] == [2, 1])


@pytest.mark.parametrize("case", CASES[:3])
def test_nsa_prob_rank_matches_oracle(case):
    """block_rank=nsa_prob: the group sum of per-head softmax probabilities over the block means
    (inexact in float32: the reference's choice must have a clear margin first)."""
    b, t, h, kh, d, block, s = case
    q, k, v = bo.dyadic_qkv(KEY, b, t, h, kh, d)
    scores = bo.selection_scores(q, k, block, "nsa_prob")
    assert bo.selection_margin(scores, block, s) > 1e-5
    chosen = bo.selected_blocks(q, k, block, s, scores=scores)
    idx = select_blocks(q, k, block_size=block, num_blocks=s, block_rank="nsa_prob")
    np.testing.assert_array_equal(bo.indices_to_blocks(idx, chosen.shape[-1]), chosen)
    out, lse = block_sparse_attention(q, k, v, block_size=block, num_blocks=s, block_rank="nsa_prob", return_lse=True)
    ref, ref_lse = bo.block_sparse_reference(q, k, v, block, s, chosen)
    _close(out, ref, bo.TOL[jnp.float32])
    _close(lse, ref_lse, bo.TOL[jnp.float32])


def test_nsa_prob_rank_lets_a_sharp_head_decide():
    """Head 0 wants block 0 sharply (logit 11.3 vs 0), head 1 dislikes it twice as much (-22.6):
    the summed dot product ranks block 0 last, the summed probabilities (1 + 0 vs 0 + 1/2) first."""
    q = jnp.zeros((1, 16, 2, 2)).at[:, :, 0, 0].set(16.0).at[:, :, 1, 1].set(16.0)
    k = jnp.zeros((1, 16, 1, 2)).at[:, 0:4, 0].set(jnp.array([1.0, -2.0]))
    mean_key = np.asarray(select_blocks(q, k, block_size=4, num_blocks=2))
    nsa_prob = np.asarray(select_blocks(q, k, block_size=4, num_blocks=2, block_rank="nsa_prob"))
    assert np.all(mean_key[0, 12:, 0] == [3, 1]) and np.all(nsa_prob[0, 12:, 0] == [3, 0])
    with pytest.raises(ValueError, match="block_rank"):
        select_blocks(q, k, block_size=4, num_blocks=2, block_rank="prob")


def test_causality():
    p = 29
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    noise = bo.dyadic_qkv(jax.random.PRNGKey(9), *SHAPE)
    changed = [jnp.concatenate([x[:, :p], n[:, p:]], axis=1) for x, n in zip((q, k, v), noise)]
    f = lambda q, k, v: block_sparse_attention(q, k, v, block_size=4, num_blocks=3)
    a, b = f(q, k, v), f(*changed)
    np.testing.assert_array_equal(np.asarray(a[:, :p]), np.asarray(b[:, :p]))
    assert not np.allclose(a[:, p:], b[:, p:])


def test_bad_arguments_raise():
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    for bad in (dict(block_size=0, num_blocks=2), dict(block_size=4, num_blocks=0), dict(block_size=4.0, num_blocks=2)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            block_sparse_attention(q, k, v, **bad)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        block_sparse_attention(q, np.zeros((2, 45, 4, 8)), np.zeros((2, 45, 4, 8)), block_size=4, num_blocks=2)


# --- dropped mass -------------------------------------------------------------------------


def test_dropped_mass_matches_direct_computation():
    q, k, v = bo.dyadic_qkv(KEY, *SHAPE)
    _, lse_full = dense_attention(q, k, v, return_lse=True)
    for block, s in ((4, 3), (8, 1)):
        _, lse_sparse = block_sparse_attention(q, k, v, block_size=block, num_blocks=s, return_lse=True)
        got = float(dropped_mass(lse_sparse, lse_full))
        want = bo.direct_dropped_mass(q, k, bo.selected_blocks(q, k, block, s), block)
        assert 0.0 < got < 1.0
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
        per_head = dropped_mass(lse_sparse, lse_full, axis=(0, 1))
        assert per_head.shape == (6,) and np.all(np.asarray(per_head) > 0)
    _, lse_sparse = block_sparse_attention(q, k, v, block_size=4, num_blocks=12, return_lse=True)  # all blocks
    assert float(dropped_mass(lse_sparse, lse_full)) == pytest.approx(0.0, abs=1e-6)


def test_dropped_mass_edges():
    full = jnp.array([0.0, 1.0, 2.0, -jnp.inf])
    sparse = jnp.array([0.0 + 1e-7, -jnp.inf, 2.0 - np.log(2.0), -jnp.inf])
    # rounding above full -> 0; empty sparse row -> 1; half the mass -> 0.5; empty full row -> 0
    np.testing.assert_allclose(np.asarray(dropped_mass(sparse, full, axis=0)), 1.5 / 4, rtol=1e-6)
    rows = jax.vmap(lambda s, f: dropped_mass(s, f))(sparse, full)
    np.testing.assert_allclose(np.asarray(rows), [0.0, 1.0, 0.5, 0.0], atol=1e-6)


@slow
@settings(max_examples=4, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 60),
    kv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 3]),
    d=st.sampled_from([2, 8]),
    block=st.integers(1, 9),
    s=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes(b, t, kv, g, d, block, s, seed):
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(seed), b, t, kv * g, kv, d)
    chosen = bo.selected_blocks(q, k, block, s)
    np.testing.assert_array_equal(bo.indices_to_blocks(select_blocks(q, k, block_size=block, num_blocks=s), chosen.shape[-1]), chosen)
    out, lse = block_sparse_attention_xla(q, k, v, block_size=block, num_blocks=s, return_lse=True, query_chunk=2 * block)
    ref, ref_lse = bo.block_sparse_reference(q, k, v, block, s, chosen)
    _close(out, ref, bo.TOL[jnp.float32])
    _close(lse, ref_lse, bo.TOL[jnp.float32])
