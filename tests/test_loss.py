"""The chunked output projection + loss: the same numbers as the full logits, a fraction of the memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.config import ModelConfig
from fibjax.model import Transformer, chunked_nll
from tests.tiers import first_fast


def _reference_nll(x_BTD, table_VD, targets_BT):
    logp = jax.nn.log_softmax(jnp.einsum("btd,vd->btv", x_BTD, table_VD), axis=-1)
    return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("t, chunk", first_fast([(40, 16), (40, 40), (40, 0), (37, 8), (64, 1)], keep=3, unpack=True))
def test_chunked_nll_and_gradients_equal_the_full_logits(t, chunk):
    kx, kt, ky = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (2, t, 16))
    table = jax.random.normal(kt, (50, 16)) * 0.3
    y = jax.random.randint(ky, (2, t), 0, 50)
    np.testing.assert_allclose(chunked_nll(x, table, y, chunk), _reference_nll(x, table, y), rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x, tab: chunked_nll(x, tab, y, chunk).mean(), (0, 1))(x, table)
    g_ref = jax.grad(lambda x, tab: _reference_nll(x, tab, y).mean(), (0, 1))(x, table)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_model_targets_give_the_nll_of_its_logits():
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, logits_chunk=8)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 64)
    logits = model(tokens[:, :-1])
    ref = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(model(tokens[:, :-1], targets_BT=tokens[:, 1:]), ref, rtol=1e-5, atol=1e-5)


def test_peak_memory_no_longer_scales_with_vocab_times_seq():
    """XLA's buffer assignment of the compiled gradient: unchunked, the temporaries hold several
    [B, T, V] float32 arrays; chunked, about one [B, chunk, V] (BUILD_NOTES, "Model", "Chunked output projection and loss")."""
    b, t, d, v = 1, 2048, 64, 8192
    x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    table = jax.ShapeDtypeStruct((v, d), jnp.float32)

    def temp_bytes(chunk):
        grad = jax.jit(jax.grad(lambda x, tab: chunked_nll(x, tab, y_arr, chunk).mean(), (0, 1)))
        return grad.lower(x, table).compile().memory_analysis().temp_size_in_bytes

    y_arr = jnp.zeros((b, t), jnp.int32)
    full_logits = b * t * v * 4
    full, chunked = temp_bytes(0), temp_bytes(256)
    assert full >= full_logits  # at least one [B, T, V] float32 buffer
    chunk_logits = b * 256 * v * 4
    assert chunked < 3 * chunk_logits < full_logits / 2, (full, chunked)  # logits and their gradient, one chunk each
