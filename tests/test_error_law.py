"""Paper B's approximation law: the probe's per-query dropped mass and error against dense
attention equal a float64 softmax computed from the definition, and obey the bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.attention import offsets
from fibjax.config import AttentionConfig, ModelConfig
from fibjax.eval.error_law import fit
from fibjax.layer_modes import DroppedMassProbe
from fibjax.model import Transformer


def test_fit_recovers_a_line_and_counts_violations():
    m = np.linspace(0, 1, 50)
    law = fit(m, 3.0 * m, 4.0 * m)
    assert law["slope"] == pytest.approx(3.0) and law["r2"] == pytest.approx(1.0) and law["bound_violations"] == 0
    assert law["max_error_over_bound"] == pytest.approx(0.75)
    assert fit(m, 3.0 * m, 2.0 * m)["bound_violations"] == 49  # every m > 0 breaks a bound of 2 m


def _reference(q, k, v, distances):
    """float64: own attention over keys i - d (d in distances), dense over j <= i; per query and
    head the dropped mass, ||o_own - o_dense|| and 2 m max_{j<=i} ||v_j||."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, e = q.shape
    g = h // k.shape[2]
    mass, error, bound = (np.zeros((b, t, h)) for _ in range(3))
    for bi in range(b):
        for i in range(t):
            for hi in range(h):
                kv = hi // g
                s = k[bi, : i + 1, kv] @ q[bi, i, hi] / np.sqrt(e)
                p = np.exp(s - s.max())
                own = np.zeros(i + 1, bool)
                own[[i - d for d in distances if d <= i]] = True
                dense_o = p @ v[bi, : i + 1, kv] / p.sum()
                own_o = p[own] @ v[bi, : i + 1, kv][own] / p[own].sum()
                mass[bi, i, hi] = 1 - p[own].sum() / p.sum()
                error[bi, i, hi] = np.linalg.norm(own_o - dense_o)
                bound[bi, i, hi] = 2 * mass[bi, i, hi] * np.linalg.norm(v[bi, : i + 1, kv], axis=-1).max()
    return mass, error, bound


def test_probe_matches_the_definition_and_the_bound_holds():
    acfg = AttentionConfig(kind="offset", window=2, alpha="fixed", base=(3, 5, 8))
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, attention=acfg)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    attn = model.blocks[0].attn
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 24, 32))
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
    q, k, v = attn.qkv(x, positions)
    _, sown = nnx.capture(lambda a: DroppedMassProbe(per_query=True)(a, q, k, v, x), nnx.Intermediate)(attn)
    got = {key: np.asarray(sown[key][0]) for key in ("mass", "error", "bound")}
    distances = offsets.attended_distances(window=2, base=(3, 5, 8), alpha=1.0, seq_len=24)
    mass, error, bound = _reference(q, k, v, distances)
    np.testing.assert_allclose(got["mass"], mass, atol=2e-5)
    np.testing.assert_allclose(got["error"], error, atol=2e-5)
    np.testing.assert_allclose(got["bound"], bound, atol=2e-5, rtol=1e-5)
    assert mass.max() > 0.1 and np.all(error <= bound + 1e-9)  # the reference itself obeys the law
    np.testing.assert_allclose(sown["dropped_mass"][0], mass.mean(axis=(1, 2)), atol=1e-5)  # per sequence
