"""The Pallas kernels against the XLA path and the oracle (interpret mode on CPU), and their
lowering for TPU (Mosaic) and GPU (Triton) without hardware.

Interpret-mode kernels are large XLA programs, so every comparison is one jitted program
(Pallas, XLA and oracle, forward and gradients together) compiled at -O0, which halves its
compile time on CPU; example counts are small.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibjax.attention import attended_distances, interpolated_attention, offset_attention
from fibjax.attention.offset_xla import interpolated_attention_xla, offset_attention_xla
from fibjax.attention.pallas import BlockSizes, interpolated_attention_pallas, kernels, offset_attention_pallas
from fibjax.attention.pallas import backend as pallas_backend
from fibjax.attention.pallas.block_kernels import VARIANTS
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from tests import oracle
from tests.tiers import first_fast, slow

F32, BF16 = jnp.float32, jnp.bfloat16
KEY = jax.random.PRNGKey(0)
jit_o0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# Pallas vs the XLA path: both keep float32 statistics and differ in summation order (and, in
# bf16, in where q is scaled and rounded), so bf16 gets a few bf16 ulps.
XLA_TOL = {F32: dict(atol=2e-5, rtol=2e-5), BF16: dict(atol=2e-2, rtol=2e-2)}
XLA_GRAD_TOL = {F32: dict(atol=5e-5, rtol=5e-5), BF16: dict(atol=6e-2, rtol=6e-2)}
# d loss / d alpha sums O(T H) terms with heavy cancellation: tolerance relative to its scale
ALPHA_RTOL = {F32: 1e-4, BF16: 3e-2}


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _value_and_grads(fn, q, k, v, alpha, w_BTHD, w_BTH):
    """(out, lse, (dq, dk, dv, dalpha)) of loss = <out, w> + <lse, w_lse>: the lse cotangent is exercised too."""

    def loss(q, k, v, a):
        out, lse = fn(q, k, v, a)
        return jnp.sum(out.astype(F32) * w_BTHD) + jnp.sum(lse * w_BTH), (out, lse)

    grads, (out, lse) = jax.grad(loss, (0, 1, 2, 3), has_aux=True)(q, k, v, alpha)
    return out, lse, grads


def _check_static_and_learned(b, t, kv, g, d, window, alpha, base, dtype, block_sizes, seed):
    q, k, v = oracle.random_qkv(jax.random.PRNGKey(seed), b, t, kv * g, kv, d, dtype)
    kw, kl = jax.random.split(jax.random.PRNGKey(seed + 1))
    w_BTHD, w_BTH = jax.random.normal(kw, q.shape), jax.random.normal(kl, q.shape[:3])
    ds = attended_distances(window=window, base=base, alpha=alpha, seq_len=t)
    learned = dict(window=window, base=base, return_lse=True)
    fns = {
        "static": (
            lambda q, k, v, a: offset_attention_pallas(q, k, v, distances=ds, return_lse=True, block_sizes=block_sizes),
            lambda q, k, v, a: offset_attention_xla(q, k, v, distances=ds, return_lse=True),
            lambda q, k, v, a: oracle.masked_attention(q, k, v, oracle.distance_mask(t, ds)),
        ),
        "learned": (
            lambda q, k, v, a: interpolated_attention_pallas(q, k, v, alpha=a, block_sizes=block_sizes, **learned),
            lambda q, k, v, a: interpolated_attention_xla(q, k, v, alpha=a, **learned),
            lambda q, k, v, a: oracle.learned_attention(q, k, v, window=window, base=base, alpha=a, alpha_value=alpha),
        ),
    }

    @jit_o0
    def everything(q, k, v, a):
        return {name: [_value_and_grads(f, q, k, v, a, w_BTHD, w_BTH) for f in trio] for name, trio in fns.items()}

    for name, (got, xla, ref) in everything(q, k, v, jnp.float32(alpha)).items():
        out, lse, grads = got
        assert out.dtype == dtype and out.shape == q.shape and lse.dtype == F32 and lse.shape == q.shape[:3]
        for other, tol, grad_tol in ((xla, XLA_TOL[dtype], XLA_GRAD_TOL[dtype]), (ref, oracle.TOL[dtype], oracle.GRAD_TOL[dtype])):
            _close(out, other[0], tol)
            _close(lse, other[1], tol)
            for i in range(3):
                assert grads[i].dtype == dtype
                _close(grads[i], other[2][i], grad_tol)
            if name == "learned":
                scale = max(1.0, float(np.max(np.abs(np.asarray(grads[0], np.float32)))))
                _close(grads[3], other[2][3], dict(atol=ALPHA_RTOL[dtype] * scale * t, rtol=ALPHA_RTOL[dtype]))


@pytest.mark.parametrize("dtype", first_fast([F32, BF16]))
def test_ragged_gqa_matches_xla_and_oracle(dtype):
    """45 tokens in blocks of 16 (a ragged last block), 3 query heads per KV head."""
    _check_static_and_learned(2, 45, 2, 3, 8, 3, 0.87, "fibonacci", dtype, BlockSizes(16, 8), seed=0)


def test_a_window_wider_than_a_block_is_a_band_tile_and_slots():
    """W = 12 over blocks of 8 (forward, dq: band 0..8, slots 9..12) and 16 (dk/dv: all band)."""
    _check_static_and_learned(1, 40, 2, 2, 8, 12, 1.1, "fibonacci", F32, BlockSizes(8, 16), seed=3)


def test_the_band_takes_the_leading_run_of_distances():
    band = kernels._band
    assert band((0, 1, 2, 3, 5, 8), 2, "interpret") == (2, (3, 5, 8))
    assert band((0, 1, 2, 3, 5, 8), 16, "mosaic_tpu") == (3, (5, 8))
    assert band((1, 2, 5), 16, "interpret") == (None, (1, 2, 5))  # no distance 0: no band
    assert band((0, 1, 2), 8, "triton") == (None, (0, 1, 2))  # Triton's dot wants sides >= 16
    assert band((0, 1, 2), 16, "triton") == (2, ())


@slow
@settings(max_examples=4, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 60),
    kv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([4, 8, 16]),
    window=st.integers(0, 6),
    alpha=st.floats(0.5, 1.5),
    base=st.sampled_from(["fibonacci", "pow2", (3, 9, 40)]),
    dtype=st.sampled_from([F32, BF16]),
    block_q=st.sampled_from([8, 16, 32]),
    block_k=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_match_xla_and_oracle(b, t, kv, g, d, window, alpha, base, dtype, block_q, block_k, seed):
    _check_static_and_learned(b, t, kv, g, d, window, alpha, base, dtype, BlockSizes(block_q, block_k), seed)


def test_rows_without_keys_are_zero_with_minus_inf_lse():
    q, k, v = oracle.random_qkv(KEY, 1, 20, 2, 2, 4)
    bs = BlockSizes(8, 8)

    @jit_o0
    def both(q):
        out, lse = offset_attention_pallas(q, k, v, distances=(3, 7), return_lse=True, block_sizes=bs)
        g = jax.grad(lambda q: jnp.sum(offset_attention_pallas(q, k, v, distances=(3, 7), block_sizes=bs)))(q)
        g_xla = jax.grad(lambda q: jnp.sum(offset_attention_xla(q, k, v, distances=(3, 7))))(q)
        return out, lse, g, g_xla, offset_attention_xla(q, k, v, distances=(3, 7))

    out, lse, g, g_xla, ref = both(q)
    assert np.all(np.asarray(out[:, :3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :3])))
    assert np.all(np.isfinite(np.asarray(lse[:, 3:])))
    _close(out, ref, XLA_TOL[F32])
    _close(g, g_xla, XLA_GRAD_TOL[F32])


def test_alpha_change_does_not_recompile():
    q, k, v = oracle.random_qkv(KEY, 1, 40, 2, 1, 8)
    traces = []

    @jit_o0
    def f(a):
        traces.append(1)
        return interpolated_attention_pallas(q, k, v, window=2, base="fibonacci", alpha=a, block_sizes=BlockSizes(16, 16))

    outs = [f(jnp.float32(a)) for a in (0.6, 1.0, 1.37)]
    assert len(traces) == 1
    assert not np.allclose(outs[0], outs[2])


def test_dispatch(monkeypatch):
    q, k, v = oracle.random_qkv(KEY, 1, 16, 2, 2, 4)
    ds = (0, 1, 5)
    xla = offset_attention(q, k, v, distances=ds, implementation="xla")
    _close(offset_attention(q, k, v, distances=ds, implementation="pallas"), xla, XLA_TOL[F32])
    _close(offset_attention(q, k, v, distances=ds), xla, XLA_TOL[F32])
    assert not pallas_backend.use_pallas(None)  # CPU: XLA
    with pytest.raises(ValueError, match="implementation"):
        interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=1.0, implementation="triton")
    with pytest.raises(ValueError, match="alpha"):
        interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=1.7, implementation="pallas")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)
    assert BlockSizes(128, 64).fit(40) == BlockSizes(64, 64)
    for platform, backend in (("gpu", "triton"), ("tpu", "mosaic_tpu")):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        assert pallas_backend.default_backend() == backend
        # never run on that hardware yet: the default stays XLA until its check is recorded
        assert not pallas_backend.use_pallas(None) and pallas_backend.use_pallas("pallas")


# --- lowering without hardware ----------------------------------------------------------------
# Proves that Mosaic / Triton accept every kernel (block shapes, ops, dtypes); it does not
# compile for the device (``.compile()`` here would target the CPU) or prove speed.

LOWERINGS = {"tpu": ("mosaic_tpu", "@tpu_custom_call"), "cuda": ("triton", "@__gpu$xla.gpu.triton")}
BLOCK_VARIANTS = ["combined", *(v for v in VARIANTS if v not in ("default", "combined"))]  # the default is the test above


def assert_kernels(text: str, marker: str, platform: str, name: str, parts=("fwd", "dq", "dkdv")) -> None:
    """A lowered training step holds exactly the kernels NAME_PART of ``parts``; on cuda the Triton
    lowering with explicit compiler parameters (not Mosaic GPU)."""
    assert text.count(marker) == len(parts)
    if platform == "cuda":
        assert text.count("num_warps = 4 : i32") == len(parts) and text.count("num_stages = 2 : i32") == len(parts)
    for part in parts:
        assert f"{name}_{part}" in text


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("path", ["static", "learned"])
@pytest.mark.parametrize("platform", sorted(LOWERINGS))
def test_forward_and_backward_lower_without_hardware(platform, path, dtype):
    backend, marker = LOWERINGS[platform]
    t, window = 512, 12
    ds = attended_distances(window=window, base="fibonacci", alpha=1.03, seq_len=t)
    attend = {
        "static": lambda q, k, v, a: offset_attention_pallas(q, k, v, distances=ds, return_lse=True, backend=backend),
        "learned": lambda q, k, v, a: interpolated_attention_pallas(q, k, v, window=window, base="fibonacci", alpha=a, return_lse=True, backend=backend),
    }[path]

    def fwd_and_grads(q, k, v, a):  # the forward kernel, then dq and dk/dv, in one program
        return _value_and_grads(attend, q, k, v, a, jnp.ones(q.shape, F32), jnp.ones(q.shape[:3], F32))

    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((2, t, 8, 64), (2, t, 2, 64), (2, t, 2, 64))] + [jax.ShapeDtypeStruct((), F32)]
    text = jax.jit(fwd_and_grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert_kernels(text, marker, platform, "offset_attention")


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("platform", sorted(LOWERINGS))
def test_block_sparse_kernels_lower_without_hardware(platform, dtype):
    """The block-sparse tile kernels (forward; backward: dq rows, dk/dv) in a training step's
    program; on TPU the tiles' blocks are scalar-prefetched (the K/V block chosen by its index map)."""
    backend, marker = LOWERINGS[platform]
    attend = functools.partial(block_sparse_attention_pallas, block_size=16, num_blocks=4, return_lse=True, backend=backend)

    def fwd_and_grads(q, k, v):
        return jax.grad(lambda q, k, v: sum(jnp.sum(x.astype(F32)) for x in attend(q, k, v)), (0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((2, 512, 8, 64), (2, 512, 2, 64), (2, 512, 2, 64))]
    text = jax.jit(fwd_and_grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert_kernels(text, marker, platform, "block_sparse_attention", ("fwd", "bwd"))


@pytest.mark.parametrize(
    ("platform", "variant", "dtype"), first_fast([(p, v, d) for v in BLOCK_VARIANTS for d in (BF16, F32) for p in sorted(LOWERINGS)], 2, unpack=True)
)
def test_block_sparse_variants_lower_without_hardware(platform, variant, dtype):
    """Each variant of the block-sparse kernels (``block_kernels.VARIANTS``) in a training step's
    program, as above; on TPU a variant that gathers rows in the kernel is refused by name (Mosaic
    has no gather of rows from VMEM), every other one lowers."""
    backend, marker = LOWERINGS[platform]
    options = VARIANTS[variant]
    attend = functools.partial(block_sparse_attention_pallas, block_size=16, num_blocks=4, return_lse=True, backend=backend, options=options)

    def fwd_and_grads(q, k, v):
        return jax.grad(lambda q, k, v: sum(jnp.sum(x.astype(F32)) for x in attend(q, k, v)), (0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((2, 512, 8, 64), (2, 512, 2, 64), (2, 512, 2, 64))]
    lower = lambda: jax.jit(fwd_and_grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()  # noqa: E731
    if platform == "tpu" and options.gather_in_kernel:
        with pytest.raises(ValueError, match="gather_in_kernel"):
            lower()
        return
    assert_kernels(lower(), marker, platform, "block_sparse_attention", ("fwd", "bwd"))
