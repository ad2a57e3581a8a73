"""The Pallas block-sparse tile kernels (interpret mode on CPU: forward, backward) against the
loop-and-mask reference (tests/block_oracle.py), forward, lse and gradients; the tile map's
invariants against a plain count; padding rows masked; the TPU layout (scalar prefetch) against
the GPU one. Their lowering for GPU and TPU is in tests/test_pallas.py beside the offset kernels'.

Dyadic inputs (selections exact, ties included) and the oracle's per-dtype tolerances: output
and lse fp32 2e-5, bf16 3e-2; gradients fp32 1e-4, bf16 8e-2. Each comparison is one program
compiled at -O0 (interpret-mode kernels are large XLA programs).

The kernels' variants (``block_kernels.VARIANTS``, issue 53) go through the same comparisons
(one case each in the fast tier), with the same tolerances except bf16 partials (``PARTIALS_TOL``).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fibjax.attention.pallas import BlockSizes, block_kernels, block_ops
from fibjax.attention.pallas.block_kernels import VARIANTS, BlockKernelOptions
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from tests import block_oracle as bo
from tests.tiers import first_fast

jit_o0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# (batch, T, q heads, kv heads, head dim, block, S, query rows per tile): a ragged tail with
# G = 4 and blocks spread over several tiles, MHA (G = 1) with S above the block count, G = 2 with
# one tile per block, G = 3, a sequence shorter than one block
CASES = [(2, 45, 8, 2, 8, 4, 3, 8), (1, 40, 2, 2, 4, 8, 9, 8), (1, 64, 4, 2, 16, 8, 4, 64), (1, 30, 6, 2, 8, 4, 4, 4), (1, 5, 4, 2, 4, 8, 2, 8)]


# bf16 partials round every partial (o, dq rows, dk and dv partials) once to 8 significant bits
# (relative error <= 2^-9) before the merges sum them in float32. The output is a convex
# combination of its partials, each |o_s| <= max|v| = 3 here, so it moves by <= 3 * 2^-9 = 5.9e-3
# (measured 4.9e-3 in fp32), far above fp32's 2e-5: fp32 inputs get 1e-2. A gradient sums several
# partials (dk, dv: every tile of its block), each off by 2^-9 of its own size: 4e-2 (measured
# <= 1.7e-2). bf16 inputs already round q, k, v, out and the gradients to the same 8 bits, so they
# keep the bf16 tolerances (measured out 6.5e-3, dk 3.1e-2). lse stays float32 in every variant.
PARTIALS_TOL = {jnp.float32: (dict(atol=1e-2, rtol=1e-2), dict(atol=4e-2, rtol=4e-2)), jnp.bfloat16: (bo.TOL[jnp.bfloat16], bo.GRAD_TOL[jnp.bfloat16])}
OTHER_VARIANTS = [name for name in VARIANTS if name != "default"]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _check_against_oracle(q, k, v, dtype, block, s, block_sizes, options=VARIANTS["default"]):
    w_out, w_lse = (jax.random.normal(key, shape) for key, shape in zip(jax.random.split(jax.random.PRNGKey(1)), (q.shape, q.shape[:3])))
    chosen = bo.selected_blocks(q, k, block, s)  # the choice has no gradient

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), (out, lse)

    kernel = lambda q, k, v: block_sparse_attention_pallas(q, k, v, block_size=block, num_blocks=s, return_lse=True, block_sizes=block_sizes, options=options)
    reference = lambda q, k, v: bo.block_sparse_reference(q, k, v, block, s, chosen)

    @jit_o0
    def both(q, k, v):
        return [jax.grad(functools.partial(loss, fn), (0, 1, 2), has_aux=True)(q, k, v) for fn in (kernel, reference)]

    (grads, (out, lse)), (ref_grads, (ref, ref_lse)) = both(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    tol, grad_tol = PARTIALS_TOL[dtype] if options.bf16_partials else (bo.TOL[dtype], bo.GRAD_TOL[dtype])
    _close(out, ref, tol)
    _close(lse, ref_lse, bo.TOL[dtype])
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        _close(g, r, grad_tol)
    return chosen


@pytest.mark.parametrize("dtype", first_fast([jnp.float32, jnp.bfloat16]))
@pytest.mark.parametrize("case", first_fast(CASES))
def test_kernel_matches_oracle_forward_and_backward(case, dtype):
    b, t, h, kh, d, block, s, rows = case
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), b, t, h, kh, d, dtype)
    _check_against_oracle(q, k, v, dtype, block, s, BlockSizes(rows, rows))


# the variants on a ragged GQA case (G = 4: fast), MHA with S above the block count, G = 3
VARIANT_CASES = [(CASES[0], jnp.float32), (CASES[0], jnp.bfloat16), (CASES[1], jnp.float32), (CASES[3], jnp.bfloat16)]


@pytest.mark.parametrize(("case", "dtype"), first_fast(VARIANT_CASES, unpack=True))
@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_each_variant_matches_oracle_forward_and_backward(variant, case, dtype):
    b, t, h, kh, d, block, s, rows = case
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), b, t, h, kh, d, dtype)
    _check_against_oracle(q, k, v, dtype, block, s, BlockSizes(rows, rows), VARIANTS[variant])


@pytest.mark.parametrize(
    ("variant", "dtype"), first_fast([("default", jnp.float32), ("default", jnp.bfloat16), *((v, jnp.float32) for v in OTHER_VARIANTS)], unpack=True)
)
def test_block_chosen_by_every_query_spans_many_tiles(variant, dtype):
    """Block 0's keys are all 3 and every q is positive, so every query chooses block 0: 64 pairs
    of one block in tiles of 8 rows (dk/dv summed over 8 programs' partials, each query's output
    merged over 3 tiles)."""
    t, block, rows = 64, 4, 8
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(2), 1, t, 4, 2, 8, dtype)
    q, k = jnp.abs(q) + 0.125, k.at[:, :block].set(3)
    chosen = _check_against_oracle(q, k, v, dtype, block, 3, BlockSizes(rows, rows), VARIANTS[variant])
    assert np.all(chosen[0, :, :, 0].sum(axis=0) == t) and t >= 8 * rows


def test_tile_map_holds_every_pair_once_in_tiles_of_one_block():
    """``tile_map`` against a plain count: every (query, chosen block) pair sits in exactly one
    tile row of a tile of that block, the forward index points at it, the other rows are padding
    (-1), at most R - 1 of them a block in the tiles a block fills; the tile count is the static
    bound ceil(T S / R) + N; tiles are sorted by block; queries past the sequence take no pair;
    the tiles holding a pair are the first ``used`` of each head."""
    b, kh, t, s, n, r, seq_len = 2, 2, 24, 3, 6, 4, 22
    blocks = jax.random.randint(jax.random.PRNGKey(3), (b, kh, t, s), -1, n)
    tiles = block_ops.tile_map(blocks, n, r, seq_len)
    x = tiles.rows.shape[2]
    assert x == -(-t * s // r) + n and tiles.index.shape == blocks.shape
    rows, index = np.asarray(tiles.rows).reshape(b * kh, x * r), np.asarray(tiles.index).reshape(b * kh, t, s)
    tile_blocks = np.asarray(tiles.blocks).reshape(b * kh, x)
    for head, idx_TS in enumerate(np.asarray(blocks).reshape(b * kh, t, s)):
        real = (idx_TS >= 0) & (np.arange(t) < seq_len)[:, None]
        want = sorted((int(q), int(m)) for q, m in zip(np.nonzero(real)[0], idx_TS[real]))
        got = sorted((int(rows[head, z]), int(tile_blocks[head, z // r])) for z in np.nonzero(rows[head] >= 0)[0])
        assert got == want
        for q, slot in zip(*np.nonzero(real)):  # the forward index finds each pair's row
            z = index[head, q, slot]
            assert rows[head, z] == q and tile_blocks[head, z // r] == idx_TS[q, slot]
        assert np.all(index[head][~real] == x * r)
        assert np.all(np.diff(tile_blocks[head]) >= 0)
        holds_pair = (rows[head].reshape(x, r) >= 0).any(axis=1)
        used = int(np.asarray(tiles.used).reshape(-1)[head])
        assert holds_pair[:used].all() and not holds_pair[used:].any()
        for m in range(n):
            filled = np.unique(np.nonzero(rows[head] >= 0)[0] // r)
            used = filled[tile_blocks[head, filled] == m]
            count = sum(1 for _, mm in want if mm == m)
            assert len(used) == -(-count // r)  # ceil(c / R) tiles: at most R - 1 padding rows


def test_spans_name_each_span_once_with_the_blocks_chosen_in_it():
    """``spans`` against a plain loop: a query's blocks as spans of m blocks, each span at the first
    slot naming it (-1 elsewhere), its bits the blocks chosen in it; laid out in the tiles, each
    pair's row carries its bits."""
    m, n, t, s = 4, 12, 16, 5
    own = jnp.broadcast_to((jnp.arange(t) * n // t)[:, None], (1, 2, t, 1))
    earlier = jax.random.permutation(jax.random.PRNGKey(5), jnp.broadcast_to(jnp.arange(n), (1, 2, t, n)), axis=-1, independent=True)[..., : s - 1]
    idx = jnp.concatenate([own, jnp.where(earlier < own, earlier, -1)], axis=-1)  # distinct blocks, some empty slots
    span, bits = (np.asarray(a) for a in block_ops.spans(idx, m))
    for b, h, q in np.ndindex(*idx.shape[:3]):
        chosen = [int(c) for c in np.asarray(idx)[b, h, q] if c >= 0]
        want = {}
        for c in chosen:
            want[c // m] = want.get(c // m, 0) | 1 << (c % m)
        got = {int(sp): int(bt) for sp, bt in zip(span[b, h, q], bits[b, h, q]) if sp >= 0}
        assert got == want and np.all(bits[b, h, q][span[b, h, q] < 0] == 0)
        firsts = [int(np.nonzero(np.asarray(idx)[b, h, q] // m == sp)[0][0]) for sp in want]  # each span at its first slot
        assert sorted(firsts) == sorted(np.nonzero(span[b, h, q] >= 0)[0].tolist())
    tiles = block_ops.tile_map(jnp.asarray(span), -(-n // m), 4, t, jnp.asarray(bits))
    x_r = np.asarray(tiles.bits).reshape(2, -1)
    for (b, h, q, slot), sp in np.ndenumerate(span):
        if sp >= 0:
            assert x_r[h, np.asarray(tiles.index)[b, h, q, slot]] == bits[b, h, q, slot]


def _tile_inputs(seed=4, b=1, kh=2, g=2, t=16, d=8, block=4, r=4):
    """A tile map of a random causal choice (own block first, then earlier blocks or -1) and random
    per-row operands in its layout."""
    n = t // block
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    own = jnp.broadcast_to((jnp.arange(t) // block)[:, None], (b, kh, t, 1))
    earlier = jax.random.randint(ks[0], (b, kh, t, 2), -1, n)
    tiles = block_ops.tile_map(jnp.concatenate([own, jnp.where(earlier < own, earlier, -1)], axis=-1), n, r, t)
    x = tiles.rows.shape[2]
    pos = jnp.repeat(tiles.rows, g, axis=-1)[..., None]
    q, do = (jax.random.normal(kk, (b, kh, x, r * g, d)) for kk in ks[1:3])
    k, v = (jax.random.normal(kk, (b, kh, t, d)) for kk in ks[3:5])
    lse, delta = (jax.random.normal(kk, pos.shape) for kk in ks[5:7])
    return tiles, pos, q, k, v, do, lse, delta


def test_padding_rows_are_masked_and_tpu_layout_matches_gpu_layout():
    """Padding rows (position -1) give o = 0, lse = -inf, no dq and nothing in dk/dv; with the tile
    blocks scalar-prefetched and the K/V block chosen by the index map (TPU) the kernels give what
    they give reading the blocks as an array and slicing whole K/V (GPU)."""
    tiles, pos, q, k, v, do, lse, delta = _tile_inputs()
    kw = dict(block=4, backend="interpret", block_sizes=BlockSizes(4, 4))
    pad = np.asarray(pos[..., 0]) < 0
    assert pad.any() and (~pad).any()
    for prefetch in (True, False):
        o, lse_part = block_kernels.forward(tiles.blocks, pos, q, k, v, prefetch=prefetch, **kw)
        assert np.all(np.asarray(o)[pad] == 0) and np.all(np.asarray(lse_part)[..., 0][pad] == -np.inf)
        assert np.all(np.isfinite(np.asarray(lse_part)[..., 0][~pad]))
        dq, dk, dv = block_kernels.backward(tiles.blocks, pos, q, k, v, do, lse, delta, prefetch=prefetch, **kw)
        assert np.all(np.asarray(dq)[pad] == 0)
        # the padding rows' q and do are random: had they leaked into dk / dv, these would differ
        clean = block_kernels.backward(
            tiles.blocks, pos, jnp.where(pad[..., None], 0.0, q), k, v, jnp.where(pad[..., None], 0.0, do), lse, delta, prefetch=prefetch, **kw
        )
        for got, want in zip((dk, dv), clean[1:]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    for tpu, gpu in zip(
        block_kernels.forward(tiles.blocks, pos, q, k, v, prefetch=True, **kw), block_kernels.forward(tiles.blocks, pos, q, k, v, prefetch=False, **kw)
    ):
        np.testing.assert_allclose(np.asarray(tpu), np.asarray(gpu), rtol=1e-6, atol=1e-6)
    args = (tiles.blocks, pos, q, k, v, do, lse, delta)
    for tpu, gpu in zip(block_kernels.backward(*args, prefetch=True, **kw), block_kernels.backward(*args, prefetch=False, **kw)):
        assert np.any(np.asarray(gpu) != 0)
        np.testing.assert_allclose(np.asarray(tpu), np.asarray(gpu), rtol=1e-6, atol=1e-6)


def test_skipped_tiles_write_nothing_and_options_keep_tpu_layout_equal_to_gpu_layout():
    """With ``skip_padding_tiles`` the programs past ``used`` write nothing (the interpreter leaves
    an unwritten output NaN, so the merges, which pass the oracle tests, never read them) and the
    others write what they write without it; with spans of 2 blocks, bf16 partials and the skip, the
    TPU layout (spans and ``used`` scalar-prefetched) gives what the GPU layout gives."""
    b, kh, g, t, d, block, r, m = 1, 2, 2, 32, 8, 4, 4, 2
    options = BlockKernelOptions(bf16_partials=True, skip_padding_tiles=True, blocks_per_tile=m)
    ks = jax.random.split(jax.random.PRNGKey(6), 7)
    own = jnp.broadcast_to((jnp.arange(t) // block)[:, None], (b, kh, t, 1))
    earlier = jax.random.randint(ks[0], (b, kh, t, 2), -1, t // block)
    span, bits = block_ops.spans(jnp.concatenate([own, jnp.where(earlier < own, earlier, -1)], axis=-1), m)
    tiles = block_ops.tile_map(span, t // (block * m), r, t, bits)
    x = tiles.rows.shape[2]
    pos, bits_rows = (jnp.repeat(a, g, axis=-1)[..., None] for a in (tiles.rows, tiles.bits))
    q, do = (jax.random.normal(kk, (b, kh, x, r * g, d)) for kk in ks[1:3])
    k, v = (jax.random.normal(kk, (b, kh, t, d)) for kk in ks[3:5])
    lse, delta = (jax.random.normal(kk, pos.shape) for kk in ks[5:7])
    kw = dict(block=block, backend="interpret", block_sizes=BlockSizes(r, r), bits=bits_rows)
    used = np.asarray(tiles.used)
    assert np.all(used < x)  # some tiles hold only padding
    live = np.arange(x)[None, None, :] < used[:, :, None]
    fwd, bwd = {}, {}
    for prefetch, opts in ((False, options), (True, options), (False, dataclasses.replace(options, skip_padding_tiles=False))):
        extra = dict(used=tiles.used) if opts.skip_padding_tiles else {}
        fwd[prefetch, opts] = block_kernels.forward(tiles.blocks, pos, q, k, v, options=opts, prefetch=prefetch, **kw, **extra)
        bwd[prefetch, opts] = block_kernels.backward(tiles.blocks, pos, q, k, v, do, lse, delta, options=opts, prefetch=prefetch, **kw, **extra)
        assert fwd[prefetch, opts][0].dtype == jnp.bfloat16 and fwd[prefetch, opts][1].dtype == jnp.float32
    everything = (False, dataclasses.replace(options, skip_padding_tiles=False))
    for outs in (fwd, bwd):
        for got_gpu, got_tpu, want in zip(outs[False, options], outs[True, options], outs[everything]):
            for got in (got_gpu, got_tpu):
                got, want_ = np.asarray(got, np.float32), np.asarray(want, np.float32)
                assert np.all(np.isnan(got[~live])) and not np.isnan(want_[~live]).any()
                np.testing.assert_array_equal(got[live], want_[live])


@pytest.mark.parametrize(
    ("backend", "heads", "head_dim", "block", "problem"),
    [
        ("triton", 6, 16, 16, "heads per KV head"),
        ("triton", 4, 12, 16, "head_dim"),
        ("triton", 4, 16, 12, "block_size"),
        ("triton", 4, 8, 16, "head_dim >= 16"),
        ("triton", 4, 16, 8, "block_size >= 16"),
        ("mosaic_tpu", 4, 8, 12, "block_size"),
        ("mosaic_tpu", 4, 8, 8, "gather_in_kernel"),
    ],
)
def test_shapes_a_compiler_rejects_are_named(backend, heads, head_dim, block, problem):
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(0), 1, 64, heads, 2, head_dim)
    options = VARIANTS["gather"] if problem == "gather_in_kernel" else None
    with pytest.raises(ValueError, match=problem):
        block_sparse_attention_pallas(q, k, v, block_size=block, num_blocks=2, backend=backend, options=options)


def test_blocks_per_tile_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="blocks_per_tile"):
        BlockKernelOptions(blocks_per_tile=3)


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
