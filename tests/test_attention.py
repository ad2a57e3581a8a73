"""Every XLA attention path against the oracle (tests/oracle.py), forward and backward."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fibjax.attention import attended_distances, dense_attention, interpolated_attention, offset_attention
from fibjax.attention.dense import dense_attention_xla
from tests import oracle
from tests.tiers import first_fast, slow

KEY = jax.random.PRNGKey(0)
DTYPES = [jnp.float32, jnp.bfloat16]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "window, alpha, base", [(2, 1.0, "fibonacci"), (4, 0.5, "fibonacci"), (3, 1.4333, "fibonacci"), (2, 1.0, "pow2"), (1, 1.0, (3, 9, 40))]
)
def test_static_matches_masked_oracle(dtype, window, alpha, base):
    t = 96
    q, k, v = oracle.random_qkv(KEY, 2, t, 4, 2, 16, dtype)
    ds = attended_distances(window=window, base=base, alpha=alpha, seq_len=t)
    out, lse = offset_attention(q, k, v, distances=ds, return_lse=True)
    ref, ref_lse = oracle.masked_attention(q, k, v, oracle.distance_mask(t, ds))
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32
    _close(out, ref, oracle.TOL[dtype])
    _close(lse, ref_lse, oracle.TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_gradients_match_oracle(dtype):
    t = 64
    q, k, v = oracle.random_qkv(KEY, 1, t, 4, 2, 16, dtype)
    ds = attended_distances(window=3, base="fibonacci", alpha=1.0, seq_len=t)
    mask = oracle.distance_mask(t, ds)
    w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
    got = jax.grad(lambda *a: jnp.sum(offset_attention(*a, distances=ds).astype(jnp.float32) * w), (0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(oracle.masked_attention(*a, mask)[0] * w), (0, 1, 2))(q, k, v)
    for g, r in zip(got, ref):
        assert g.dtype == dtype
        _close(g, r, oracle.GRAD_TOL[dtype])


def test_window_covering_everything_is_dense():
    t = 50
    q, k, v = oracle.random_qkv(KEY, 2, t, 4, 4, 8)
    ds = attended_distances(window=t - 1, base="fibonacci", alpha=1.0, seq_len=t)
    _close(offset_attention(q, k, v, distances=ds), dense_attention(q, k, v), oracle.TOL[jnp.float32])
    learned = interpolated_attention(q, k, v, window=t - 1, base="fibonacci", alpha=1.3)
    _close(learned, dense_attention(q, k, v), oracle.TOL[jnp.float32])


@pytest.mark.parametrize("dtype", first_fast(DTYPES))
def test_dense_matches_oracle_including_chunked(dtype):
    """One chunk, unrolled chunks (ragged last chunk included) and mapped chunks (padded; in runs
    that each read the keys up to their end): the output, the lse, and the custom backward's
    gradients to q, k, v through both outputs."""
    t = 40
    q, k, v = oracle.random_qkv(KEY, 2, t, 6, 2, 8, dtype)
    causal = np.tril(np.ones((t, t), bool))
    ref, ref_lse = oracle.masked_attention(q, k, v, causal)
    w, w_lse = jax.random.normal(jax.random.PRNGKey(2), q.shape), jax.random.normal(jax.random.PRNGKey(3), q.shape[:3])

    def loss(attend):
        def f(q, k, v):
            out, lse = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)

        return jax.grad(f, (0, 1, 2))

    g_ref = loss(lambda q, k, v: oracle.masked_attention(q, k, v, causal))(q, k, v)
    # one shot; unrolled chunks (a ragged last one); mapped chunks (padded to 42 = 6 x 7) in one run,
    # in 4 uneven runs, and in more runs asked for than there are chunks (6)
    for chunk, unroll, runs in ((1024, 0, 8), (7, 4096, 8), (7, 0, 1), (7, 0, 4), (7, 0, 8)):
        attend = functools.partial(dense_attention_xla, return_lse=True, query_chunk=chunk, unroll_max_len=unroll, key_segments=runs)
        out, lse = attend(q, k, v)
        _close(out, ref, oracle.TOL[dtype])
        _close(lse, ref_lse, oracle.TOL[dtype])
        for g, r in zip(loss(attend)(q, k, v), g_ref):
            assert g.dtype == dtype
            _close(g, r, oracle.GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", first_fast(DTYPES))
def test_dense_key_tiles_match_oracle(dtype):
    """Chunks longer than a key tile (dense.KEY_TILE = 256): a chunk of 512 reads its keys in tiles,
    the ones before its first query unmasked, the rest masked, the last padded; unrolled (a ragged
    second chunk) and mapped (the queries padded to 1024; tiles past a chunk's end skipped)."""
    t = 600
    q, k, v = oracle.random_qkv(KEY, 1, t, 2, 1, 8, dtype)
    causal = np.tril(np.ones((t, t), bool))
    w, w_lse = jax.random.normal(jax.random.PRNGKey(2), q.shape), jax.random.normal(jax.random.PRNGKey(3), q.shape[:3])

    def grads(attend):
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)[0].astype(jnp.float32) * w) + jnp.sum(attend(q, k, v)[1] * w_lse), (0, 1, 2))(q, k, v)

    ref, ref_lse = oracle.masked_attention(q, k, v, causal)
    g_ref = grads(lambda q, k, v: oracle.masked_attention(q, k, v, causal))
    for unroll, runs in ((4096, 8), (0, 2)):
        attend = functools.partial(dense_attention_xla, return_lse=True, query_chunk=512, unroll_max_len=unroll, key_segments=runs)
        out, lse = attend(q, k, v)
        _close(out, ref, oracle.TOL[dtype])
        _close(lse, ref_lse, oracle.TOL[dtype])
        for g, r in zip(grads(attend), g_ref):
            _close(g, r, oracle.GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", first_fast([1.0, 0.73, 0.5, 1.21, 1.4999], keep=2))
@pytest.mark.parametrize("base", ["fibonacci", "pow2"])
def test_learned_matches_oracle(dtype, alpha, base):
    """Both forms of alpha: an array (traced in training) and a Python float (frozen: the rungs
    compiled as constants with static shifts)."""
    t = 120
    q, k, v = oracle.random_qkv(KEY, 2, t, 4, 2, 16, dtype)
    ref, ref_lse = oracle.learned_attention(q, k, v, window=4, base=base, alpha=alpha)
    for a in (jnp.float32(alpha), alpha):
        out, lse = interpolated_attention(q, k, v, window=4, base=base, alpha=a, return_lse=True)
        _close(out, ref, oracle.TOL[dtype])
        _close(lse, ref_lse, oracle.TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen_alpha_gradients_match_oracle(dtype):
    t, alpha = 90, 1.13
    q, k, v = oracle.random_qkv(KEY, 1, t, 4, 2, 16, dtype)
    w = jax.random.normal(jax.random.PRNGKey(5), q.shape)
    fast = lambda q, k, v: jnp.sum(interpolated_attention(q, k, v, window=3, base="fibonacci", alpha=alpha).astype(jnp.float32) * w)  # noqa: E731
    slow = lambda q, k, v: jnp.sum(oracle.learned_attention(q, k, v, window=3, base="fibonacci", alpha=alpha)[0].astype(jnp.float32) * w)  # noqa: E731
    for g, r in zip(jax.grad(fast, (0, 1, 2))(q, k, v), jax.grad(slow, (0, 1, 2))(q, k, v)):
        _close(g, r, oracle.GRAD_TOL[dtype])


def test_learned_at_alpha_one_equals_static():
    t = 200
    q, k, v = oracle.random_qkv(KEY, 1, t, 4, 2, 16)
    for window in (0, 5, 12):
        ds = attended_distances(window=window, base="fibonacci", alpha=1.0, seq_len=t)
        _close(interpolated_attention(q, k, v, window=window, base="fibonacci", alpha=1.0), offset_attention(q, k, v, distances=ds), oracle.TOL[jnp.float32])


@pytest.mark.parametrize("x64", first_fast([False, True]))
def test_learned_gradients_match_oracle(x64):
    """float64: exact to rounding. float32: the alpha gradient is a sum with heavy cancellation
    (0.126 from terms of order 1), so it gets an absolute tolerance of 1e-3."""
    t, alpha = 80, 0.87
    q, k, v = oracle.random_qkv(KEY, 1, t, 4, 2, 8)
    w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    with jax.enable_x64(x64):
        if x64:
            q, k, v, w = (x.astype(jnp.float64) for x in (q, k, v, w))
        a0 = jnp.asarray(alpha, q.dtype)
        fast = lambda q, k, v, a: jnp.sum(interpolated_attention(q, k, v, window=3, base="fibonacci", alpha=a) * w)  # noqa: E731
        slow = lambda q, k, v, a: jnp.sum(oracle.learned_attention(q, k, v, window=3, base="fibonacci", alpha=a, alpha_value=alpha)[0] * w)  # noqa: E731
        got = jax.grad(fast, (0, 1, 2, 3))(q, k, v, a0)
        ref = jax.grad(slow, (0, 1, 2, 3))(q, k, v, a0)
    tols = [dict(atol=1e-10, rtol=1e-10)] * 4 if x64 else [oracle.GRAD_TOL[jnp.float32]] * 3 + [dict(atol=1e-3, rtol=0)]
    assert abs(float(ref[3])) > 1e-2
    for g, r, tol in zip(got, ref, tols):
        _close(g, r, tol) if not x64 else np.testing.assert_allclose(np.asarray(g), np.asarray(r), **tol)


def test_alpha_gradient_nonzero_on_lattice_and_matches_finite_differences():
    t = 64  # rungs up to 55, so a 1e-3 step in alpha moves no rung across an integer below
    q, k, v = oracle.random_qkv(KEY, 1, t, 2, 2, 8)
    w = jax.random.normal(jax.random.PRNGKey(4), q.shape)
    with jax.enable_x64(True):
        q, k, v, w = (x.astype(jnp.float64) for x in (q, k, v, w))
        loss = lambda a: jnp.sum(interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=a) * w)  # noqa: E731
        g_one = jax.grad(loss)(jnp.float64(1.0))
        assert abs(float(g_one)) > 1e-6
        alpha, eps = 1.13, 1e-4
        assert all(abs(alpha * f - round(alpha * f)) > 60 * eps for f in (3, 5, 8, 13, 21, 34, 55))
        fd = (loss(alpha + eps) - loss(alpha - eps)) / (2 * eps)
        g = jax.grad(loss)(jnp.float64(alpha))
        np.testing.assert_allclose(float(g), float(fd), rtol=1e-4)


def test_alpha_change_does_not_recompile():
    q, k, v = oracle.random_qkv(KEY, 1, 64, 2, 2, 8)
    traces = []

    @jax.jit
    def f(a):
        traces.append(1)
        return interpolated_attention(q, k, v, window=4, base="fibonacci", alpha=a)

    outs = [f(jnp.float32(a)) for a in (0.6, 1.0, 1.37, 1.5)]
    assert len(traces) == 1
    assert not np.allclose(outs[0], outs[2])


@pytest.mark.parametrize("path", ["dense", "static", "learned"])
def test_causality(path):
    t, p = 64, 37
    q, k, v = oracle.random_qkv(KEY, 1, t, 4, 2, 8)
    fns = {
        "dense": lambda q, k, v: dense_attention(q, k, v),
        "static": lambda q, k, v: offset_attention(q, k, v, distances=attended_distances(window=3, base="fibonacci", alpha=1.0, seq_len=t)),
        "learned": lambda q, k, v: interpolated_attention(q, k, v, window=3, base="fibonacci", alpha=0.77),
    }
    f = fns[path]
    noise = oracle.random_qkv(jax.random.PRNGKey(9), 1, t, 4, 2, 8)
    changed = [x.at[:, p:].set(n[:, p:]) for x, n in zip((q, k, v), noise)]
    a, b = f(q, k, v), f(*changed)
    np.testing.assert_array_equal(np.asarray(a[:, :p]), np.asarray(b[:, :p]))
    assert not np.allclose(a[:, p:], b[:, p:])


def test_gqa_equals_repeated_kv_heads():
    t = 48
    q, k, v = oracle.random_qkv(KEY, 2, t, 6, 2, 8)
    k3, v3 = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    ds = attended_distances(window=2, base="fibonacci", alpha=1.0, seq_len=t)
    for f in (
        lambda k, v: dense_attention(q, k, v),
        lambda k, v: offset_attention(q, k, v, distances=ds),
        lambda k, v: interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=1.2),
    ):
        _close(f(k, v), f(k3, v3), oracle.TOL[jnp.float32])


def test_bad_arguments_raise():
    q, k, v = oracle.random_qkv(KEY, 1, 16, 4, 3, 8)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        dense_attention(q, k, v)
    q, k, v = oracle.random_qkv(KEY, 1, 16, 4, 2, 8)
    with pytest.raises(ValueError, match="distances"):
        offset_attention(q, k, v, distances=(0, -1))
    with pytest.raises(ValueError, match="alpha"):
        interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=1.7)
    with pytest.raises(ValueError, match="base"):
        interpolated_attention(q, k, v, window=2, base="fib", alpha=1.0)
    with pytest.raises(ValueError, match="4-D"):
        dense_attention(q[0], k, v)


def test_rows_without_keys_are_zero_with_minus_inf_lse():
    q, k, v = oracle.random_qkv(KEY, 1, 8, 2, 2, 4)
    out, lse = offset_attention(q, k, v, distances=(3,), return_lse=True)
    assert np.all(np.asarray(out[:, :3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :3])))
    assert np.all(np.isfinite(np.asarray(lse[:, 3:])))
    g = jax.grad(lambda q: jnp.sum(offset_attention(q, k, v, distances=(3,))))(q)
    assert np.all(np.isfinite(np.asarray(g)))


@slow
@settings(max_examples=5, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 70),
    kv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([2, 4, 8]),
    window=st.integers(0, 9),
    alpha=st.floats(0.5, 1.5),
    seed=st.integers(0, 2**16),
)
# alpha one float64 ulp below 1.5: rung 2 at 2.9999999999999996 (distance 2, reachable at t=3) in
# float64, at 3.0 (unreachable) in float32
@example(b=1, t=3, kv=1, g=1, d=2, window=0, alpha=1.4999999999999998, seed=0)
def test_hypothesis_shapes(b, t, kv, g, d, window, alpha, seed):
    # alpha is a float32 quantity on the learned path (0.5 + sigmoid(logit), and a frozen float is
    # read in the inputs' dtype so that it attends what training did): the oracle gets that value
    alpha = float(np.float32(alpha))
    q, k, v = oracle.random_qkv(jax.random.PRNGKey(seed), b, t, kv * g, kv, d)
    ds = attended_distances(window=window, base="fibonacci", alpha=alpha, seq_len=t)
    ref, _ = oracle.masked_attention(q, k, v, oracle.distance_mask(t, ds))
    _close(offset_attention(q, k, v, distances=ds), ref, oracle.TOL[jnp.float32])
    lref, _ = oracle.learned_attention(q, k, v, window=window, base="fibonacci", alpha=alpha)
    _close(interpolated_attention(q, k, v, window=window, base="fibonacci", alpha=alpha), lref, oracle.TOL[jnp.float32])
    dref, _ = oracle.masked_attention(q, k, v, np.tril(np.ones((t, t), bool)))
    _close(dense_attention(q, k, v), dref, oracle.TOL[jnp.float32])


class PublicApiUnderAndOutsideJit(chex.TestCase):
    """Every public path called directly and inside a caller's ``jit`` (chex variants): the same
    numbers as the oracle, q's shape and dtype, float32 lse."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_paths_match_the_oracle(self):
        t = 40
        q, k, v = oracle.random_qkv(KEY, 2, t, 4, 2, 8)
        ds = attended_distances(window=3, base="fibonacci", alpha=1.0, seq_len=t)
        paths = {
            "dense": (lambda q, k, v: dense_attention(q, k, v, return_lse=True), oracle.distance_mask(t, range(t))),
            "static": (lambda q, k, v: offset_attention(q, k, v, distances=ds, return_lse=True), oracle.distance_mask(t, ds)),
            "learned at alpha 1": (
                lambda q, k, v: interpolated_attention(q, k, v, window=3, base="fibonacci", alpha=jnp.float32(1.0), return_lse=True),
                oracle.distance_mask(t, ds),
            ),
        }
        for name, (fn, mask) in paths.items():
            out, lse = self.variant(fn)(q, k, v)
            ref, ref_lse = oracle.masked_attention(q, k, v, mask)
            chex.assert_shape(out, q.shape)
            chex.assert_type([out, lse], [q.dtype, jnp.float32])
            chex.assert_trees_all_close((out, lse), (ref, ref_lse), **oracle.TOL[jnp.float32], custom_message=name)
