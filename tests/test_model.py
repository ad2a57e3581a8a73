"""The LM: shapes, parameter count, per-layer attention, any length, learned alpha."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.attention import alpha_to_logit, attended_distances
from fibjax.config import AttentionConfig, ConfigError, ModelConfig
from fibjax.model import Transformer, count_params, rope, rope_frequencies
from tests import oracle
from tests.tiers import first_fast


def tiny(**attention) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, attention=AttentionConfig(**attention))


def test_paper_model_has_the_papers_parameter_count():
    cfg = ModelConfig()  # the paper's recipe is the default
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    total = count_params(model)
    non_embedding = total - cfg.vocab_size * cfg.d_model
    assert round(total / 1e6, 1) == 60.9 and round(non_embedding / 1e6, 1) == 44.1


@pytest.mark.parametrize(
    "attention",
    [
        dict(kind="dense"),
        dict(kind="offset", alpha="staggered", window=4),
        dict(kind="offset", alpha="coprime", base="pow2", window=2),
        dict(kind="offset", alpha="learned", window=3),
        dict(kind="offset", alpha="staggered", learn_alpha=True, window=3),
    ],
)
def test_forward_at_1x_and_4x_length(attention):
    """On random tokens, at 64 and 256 tokens, the logits equal those of the same weights with
    each layer's attention computed by tests/oracle from the paper's definitions (its rungs
    written out again), and changing a token changes nothing before it and its own logits.
    Tolerance: float32 against the oracle's float32 through 3 blocks, logits up to |4.8|:
    atol = rtol = 1e-4 (measured max difference 2.7e-6 to 6.1e-5, the most for the learned
    staggered model at 256; a changed token moves its own logits by >= 2.0)."""
    model = Transformer(tiny(**attention), rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x: m(x))
    for t in (64, 256):
        tokens = jax.random.randint(jax.random.PRNGKey(t), (2, t), 0, 97)
        logits = forward(model, tokens)
        assert logits.shape == (2, t, 97) and logits.dtype == jnp.float32
        np.testing.assert_allclose(logits, model(tokens, mode=oracle_attention), atol=1e-4, rtol=1e-4)
        p = t // 2
        changed = forward(model, tokens.at[:, p].set((tokens[:, p] + 1) % 97))
        np.testing.assert_array_equal(np.asarray(changed[:, :p]), np.asarray(logits[:, :p]))
        assert np.all(np.abs(changed[:, p] - logits[:, p]).max(-1) > 1e-3)


def oracle_attention(attn, q, k, v, x_BTD):
    """A layer mode: the layer's attention by tests/oracle (dense; a static layer's distances
    {0..W} and round(alpha * f) in (W, T-1]; a learned layer's interpolated rungs)."""
    acfg, t = attn.cfg.attention, q.shape[1]
    if acfg.kind == "dense":
        return oracle.masked_attention(q, k, v, oracle.distance_mask(t, range(t)))[0]
    alpha = float(attn.alpha())
    if acfg.alpha == "learned" or acfg.learn_alpha:
        return oracle.learned_attention(q, k, v, window=acfg.window, base=acfg.base, alpha=alpha, max_rung=acfg.max_rung)[0]
    return oracle.masked_attention(q, k, v, oracle.distance_mask(t, oracle_distances(acfg.window, acfg.base, alpha, t)))[0]


def oracle_distances(window: int, base, alpha: float, t: int) -> set[int]:
    """A static offset layer's attended distances at length t, by the paper's rule."""
    far = {round(alpha * f) for f in oracle.rung_list(base, t)}
    return set(range(window + 1)) | {d for d in far if window < d <= t - 1}


def test_forward_at_4096_tokens():
    """At 4096 tokens (pow2 rungs up to 2048, staggered alpha 0.5 and 1.5), a changed token
    changes exactly the logits the two layers can carry it to: positions p + d1 + d2 with each
    d in its layer's attended set (computed by the paper's rule); every other position, and
    every position before p, is bit-identical."""
    cfg = ModelConfig(
        vocab_size=256,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attention=AttentionConfig(kind="offset", alpha="staggered", base="pow2", window=8),
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x: m(x))
    t, p = 4096, 5
    tokens = jax.random.randint(jax.random.PRNGKey(0), (1, t), 0, 256)
    logits = forward(model, tokens)
    assert logits.shape == (1, t, 256) and np.all(np.isfinite(np.asarray(logits)))
    changed = forward(model, tokens.at[:, p].set((tokens[:, p] + 1) % 256))
    d1, d2 = (oracle_distances(8, "pow2", alpha, t) for alpha in model.alphas())
    reached = np.zeros(t, bool)
    reached[[p + a + b for a in d1 for b in d2 if p + a + b < t]] = True
    moved = np.abs(np.asarray(changed - logits))[0].max(-1)
    assert reached[t - 1 - 1024 :].any()  # the 4x-length rungs matter at the end of the sequence
    np.testing.assert_array_equal(moved[~reached], 0.0)
    assert np.all(moved[reached] > 0), np.flatnonzero(reached & (moved == 0))


def test_layers_get_their_schedule_and_learned_layers_own_alpha_logit():
    model = Transformer(tiny(kind="offset", alpha="staggered", window=4), rngs=nnx.Rngs(0))
    assert model.alphas() == [0.5, 1.0, 1.5]
    assert not any("alpha_logit" in str(p) for p in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0])
    learned = Transformer(tiny(kind="offset", alpha="staggered", learn_alpha=True, window=4), rngs=nnx.Rngs(0))
    np.testing.assert_allclose([float(a) for a in learned.alphas()], [0.55, 1.0, 1.45], rtol=1e-6)
    thetas = [b.attn.alpha_logit for b in learned.blocks]
    assert all(isinstance(t, nnx.Param) and t[...].shape == () for t in thetas)


def test_learned_model_gets_gradient_to_alpha_logit_at_alpha_one():
    """The gradient of the loss in each layer's alpha_logit at alpha = 1 (logit 0) equals a
    finite difference of the loss. At alpha = 1 every rung lands on an integer, where a rung
    whose lower tap falls into the window switches on: the loss jumps as alpha crosses 1 from
    below (5.076 -> 5.114 here), and the gradient there is the derivative from the right. So the
    difference is the one-sided second-order one, (-3 L(0) + 4 L(h) - L(2h)) / 2h, with
    h = 1e-3 in the logit. Measured against the gradients (0.543, -0.080, 0.143): off by at
    most 7.5e-4 at h = 1e-3, 2.1e-3 at h = 5e-4 (float32 rounding of the loss over 2h), 0.016
    at h = 4e-3 (the loss curves fast: its slope falls to 0.50 by h = 0.01). Tolerance: 1% of
    the gradient plus 3e-3."""
    model = Transformer(tiny(kind="offset", alpha="learned", window=2), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 97)

    def loss(m):
        logits = m(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    grads = nnx.grad(loss)(model)
    loss_jit, h = nnx.jit(loss), 1e-3
    for i, block in enumerate(model.blocks):
        got = float(grads["blocks"][i]["attn"]["alpha_logit"][...])
        values = []
        for step in (0.0, h, 2 * h):
            block.attn.alpha_logit[...] = jnp.float32(step)
            values.append(float(loss_jit(model)))
        block.attn.alpha_logit[...] = jnp.float32(0.0)
        finite_difference = (-3 * values[0] + 4 * values[1] - values[2]) / (2 * h)
        assert abs(got) > 1e-3 and got == pytest.approx(finite_difference, rel=0.01, abs=3e-3), (i, got, finite_difference)


def test_static_layer_uses_the_attended_set_at_run_length():
    """pow2 rungs follow the run length: one layer run at T=256 attends distance 128."""
    cfg = ModelConfig(vocab_size=97, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, attention=AttentionConfig(kind="offset", base="pow2", window=2))
    assert 128 in attended_distances(window=2, base="pow2", alpha=1.0, seq_len=256)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.PRNGKey(1), (1, 256), 0, 97)
    y = x.at[:, 0].set((x[:, 0] + 1) % 97)
    out_x, out_y = model(x), model(y)
    assert not np.allclose(out_x[:, 128], out_y[:, 128])  # distance 128 is attended
    np.testing.assert_array_equal(np.asarray(out_x[:, 127]), np.asarray(out_y[:, 127]))  # 127 is not
    np.testing.assert_array_equal(np.asarray(out_x[:, 129]), np.asarray(out_y[:, 129]))  # nor 129


def _freqs(**kw):
    return rope_frequencies(16, ModelConfig(**{"d_model": 32, "num_heads": 2, "num_kv_heads": 1, **kw}))


def test_rope_is_a_rotation_and_relative():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 16))
    pos = jnp.arange(8)[None]
    inv_freq, _ = _freqs()
    r = rope(x, pos, inv_freq)
    np.testing.assert_allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    q, k = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 1, 1, 16))
    dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([[i]]), inv_freq) * rope(k, jnp.array([[j]]), inv_freq)))  # noqa: E731
    np.testing.assert_allclose(dot(5, 2), dot(105, 102), rtol=1e-4)


def test_rope_scaling_matches_hand_computed_rotations():
    base, _ = _freqs()
    np.testing.assert_allclose(base, [1e4 ** (-i / 16) for i in range(0, 16, 2)], rtol=1e-6)
    for kind in ("ntk", "linear", "yarn"):  # a factor of 1 is the identity
        freqs, mscale = _freqs(rope_scaling=kind, rope_factor=1.0, rope_original_len=256)
        np.testing.assert_allclose(freqs, base, rtol=1e-6) and np.testing.assert_equal(mscale, 1.0)
    np.testing.assert_allclose(_freqs(rope_scaling="linear", rope_factor=4.0)[0], base / 4, rtol=1e-6)
    ntk, _ = _freqs(rope_scaling="ntk", rope_factor=4.0)
    np.testing.assert_allclose(ntk, [(1e4 * 4 ** (16 / 14)) ** (-i / 16) for i in range(0, 16, 2)], rtol=1e-5)
    assert ntk[0] == base[0] and np.isclose(ntk[-1], base[-1] / 4)  # highest frequency kept, lowest interpolated
    yarn, mscale = _freqs(rope_scaling="yarn", rope_factor=4.0, rope_original_len=256)
    wavelength = 2 * np.pi / base
    ramp = np.clip((256 / wavelength - 1) / 31, 0, 1)
    np.testing.assert_allclose(yarn, (1 - ramp) * base / 4 + ramp * base, rtol=1e-6)
    assert mscale == pytest.approx(0.1 * np.log(4) + 1)
    # the rotation itself: position 3 at the first (fastest) pair turns by 3 * inv_freq[0] radians
    x = jnp.zeros((1, 1, 1, 16)).at[..., 0].set(1.0)
    out = rope(x, jnp.array([[3]]), yarn, mscale)
    np.testing.assert_allclose([out[0, 0, 0, 0], out[0, 0, 0, 8]], mscale * np.array([np.cos(3 * yarn[0]), np.sin(3 * yarn[0])]), rtol=1e-5)


def test_learned_layer_keeps_its_rung_bound():
    """max_rung = 55 reaches a learned layer: at T = 120 and alpha 1.21 the rung 89 (lo 107)
    would be active without it. The oracle bounds its own rung list."""
    cfg = ModelConfig(
        vocab_size=97, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, attention=AttentionConfig(kind="offset", alpha="learned", window=3, max_rung=55)
    )
    attn = Transformer(cfg, rngs=nnx.Rngs(0)).blocks[0].attn
    attn.alpha_logit[...] = jnp.asarray(alpha_to_logit(1.21), jnp.float32)
    q, k, v = attn.qkv(jax.random.normal(jax.random.PRNGKey(3), (1, 120, 32)), jnp.arange(120)[None])
    ref, _ = oracle.learned_attention(q, k, v, window=3, base="fibonacci", alpha=float(attn.alpha()), max_rung=55)
    np.testing.assert_allclose(attn.attend(q, k, v), ref, **oracle.TOL[jnp.float32])


def test_bf16_compute_runs_and_stays_close_to_fp32():
    """The same weights computing in bf16 vs float32: it catches a bug of the bf16 path alone
    (a softmax scale off in bf16, say), not one both paths share (the oracle tests' job).

    Tolerance: bf16 keeps 8 significant bits (eps = 2^-8). Each of the 3 blocks rounds the
    residual stream and some ten activations to it, so the logits carry a relative RMS error of a
    few eps: measured 3.8 eps here (3.4-4.5 over 4 seeds and dense / staggered / learned layers).
    The bound is 5 eps; a softmax scale 2% off in bf16 alone gives 6.1 eps. The max-abs bound it
    replaces (0.15) was set above the worst seed of a tail statistic over ~12k logits (0.07-0.14)
    and let that bug pass."""
    cfg = tiny(kind="offset", alpha="staggered", window=3)
    m32 = Transformer(cfg, rngs=nnx.Rngs(0))
    m16 = Transformer(ModelConfig(**{**cfg.__dict__, "dtype": "bfloat16"}), rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.PRNGKey(2), (2, 64), 0, 97)
    a, b = np.asarray(m32(x)), np.asarray(m16(x))
    assert b.dtype == np.float32
    relative_rms = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
    assert relative_rms < 5 * 2.0**-8, relative_rms / 2.0**-8


SCAN_ATTENTIONS = {
    "dense": AttentionConfig(kind="dense"),
    "fib_fixed": AttentionConfig(kind="offset", alpha="fixed", window=4, max_rung=31),
    "fib_learned": AttentionConfig(kind="offset", alpha="staggered", learn_alpha=True, window=4, max_rung=31),
    "moba": AttentionConfig(kind="block_sparse", block_size=8, num_blocks=2),
}


def _loss_and_grads(cfg, tokens, **kw):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    loss = lambda m: m(tokens, targets_BT=tokens, **kw).mean()  # noqa: E731
    value, grads = nnx.value_and_grad(loss)(model)
    return value, grads


# The scan carries no attention state, so the fast tier checks the kind with parameters of its own
# under the scan (learned alpha) and one remat policy on the cheapest kind; the rest are slow variants.
SCAN_CASES = [("fib_learned", "none"), ("dense", "dots")]
SCAN_CASES += [(n, r) for r in ("none", "full", "dots") for n in SCAN_ATTENTIONS if (n, r) not in SCAN_CASES]


@pytest.mark.parametrize("name,remat", first_fast(SCAN_CASES, keep=2, unpack=True))
def test_scanned_layers_compute_the_unrolled_numbers(name, remat):
    """scan_layers (one lax.scan over stacked block parameters) and each remat policy give the
    unrolled loss and every gradient (fp32: 1e-6 loss, 1e-5 gradient: reassociation only)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=2, num_kv_heads=1, attention=SCAN_ATTENTIONS[name])
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 64)
    ref, ref_grads = _loss_and_grads(cfg, tokens)
    value, grads = _loss_and_grads(dataclasses.replace(cfg, scan_layers=True, remat=remat), tokens)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(ref_grads), atol=1e-5, rtol=1e-5)


def test_scanned_layers_sow_per_layer_as_the_loop_does():
    """SSA's alignment losses and the dropped-mass probe come out of the scan per layer, equal to
    the unrolled model's."""
    from fibjax.layer_modes import SSAStreams

    blocks = AttentionConfig(kind="block_sparse", block_size=8, num_blocks=2)
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=2, num_kv_heads=1, attention=blocks)
    tokens = jax.random.randint(jax.random.key(2), (2, 48), 0, 64)
    ssa = SSAStreams(cfg.attention, jnp.asarray(True))
    out = {}
    for scan in (False, True):
        model = Transformer(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
        _, ssa_sown = nnx.capture(model, nnx.Intermediate)(tokens, ssa=ssa)
        _, probe_sown = nnx.capture(model, nnx.Intermediate)(tokens, probe_dropped_mass=True)
        out[scan] = [(ssa_sown["blocks"][i]["attn"]["ssa_align"][0], probe_sown["blocks"][i]["attn"]["dropped_mass"][0]) for i in range(3)]
    chex.assert_trees_all_close(out[True], out[False], atol=1e-6)
    assert all(float(align) > 0 and bool(jnp.all(mass > 0)) for align, mass in out[True])  # block-sparse drops mass at 48 > 2 x 8 tokens (per sequence)


def test_scanned_program_holds_one_block_whatever_the_depth():
    """The point of scan_layers: the lowered step has as many matmuls at 6 layers as at 2."""
    tokens = jnp.zeros((1, 16), jnp.int32)

    def dots(layers: int, scan: bool) -> int:
        cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=layers, num_heads=2, num_kv_heads=1, scan_layers=scan, attention=AttentionConfig(kind="dense"))
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        grad = jax.grad(lambda p: nnx.merge(graphdef, p)(tokens, targets_BT=tokens).mean())
        return jax.jit(grad).lower(params).as_text().count("dot_general")

    assert dots(2, True) == dots(6, True)
    assert dots(6, False) > dots(2, False)


def test_scan_and_remat_settings_are_checked():
    with pytest.raises(ConfigError, match="scan_layers: needs every layer to run the same program"):
        ModelConfig(num_layers=4, scan_layers=True, attention=AttentionConfig(kind="offset", alpha="staggered"))
    with pytest.raises(ConfigError, match="remat: must be one of none, full, dots"):
        ModelConfig(remat="some")
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"  # stored run configs say true/false
    assert ModelConfig(num_layers=4, scan_layers=True, attention=AttentionConfig(kind="offset", alpha="staggered", learn_alpha=True)).scan_layers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rmsnorm_is_nnx_rmsnorm_in_float32_rounded_once(dtype):
    """fibjax's norm is nnx.RMSNorm computing in float32: x / sqrt(mean(x^2) + eps) * scale, rounded
    once to the input's dtype (bf16: bit-equal to that definition; fp32: 2 ulp), its parameter
    tree {"scale": [D]} with the embed axis, as the checkpoints hold it."""
    from fibjax.model import RMSNorm

    norm = RMSNorm(128, 1e-6, jnp.float32, rngs=nnx.Rngs(0))
    assert isinstance(norm, nnx.RMSNorm) and norm.scale.get_metadata()["logical_axes"] == ("embed",)
    assert jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(norm))) == {"scale": (128,)}
    norm.scale[...] = jax.random.normal(jax.random.key(1), (128,))
    x = (jax.random.normal(jax.random.key(0), (4, 64, 128)) * 3).astype(dtype)
    x32 = x.astype(jnp.float32)
    want = (x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * norm.scale[...]).astype(dtype)
    got = jax.jit(lambda x: norm(x))(x)
    assert got.dtype == dtype
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    else:
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=1e-6)
