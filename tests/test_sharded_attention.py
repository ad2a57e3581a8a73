"""The Pallas paths under a device mesh run per shard and compute the same function."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fibjax.attention import attended_distances, block_sparse_attention, interpolated_attention, offset_attention
from fibjax.config import MeshConfig
from fibjax.sharding import make_mesh
from tests import oracle
from tests.tiers import slow


@slow
def test_pallas_per_shard_equals_the_unsharded_xla_path():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v = oracle.random_qkv(jax.random.PRNGKey(0), 4, 40, 4, 2, 8)
    ds = attended_distances(window=3, base="fibonacci", alpha=1.0, seq_len=40)

    def loss(q, k, v, alpha, impl):
        a = offset_attention(q, k, v, distances=ds, implementation=impl)
        b, lse = interpolated_attention(q, k, v, window=2, base="fibonacci", alpha=alpha, implementation=impl, return_lse=True)
        return jnp.sum(a * b) + jnp.sum(jnp.sin(lse)), (a, b, lse)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (ref_grads, ref_out) = grad(q, k, v, jnp.float32(0.83), "xla")
    spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, spec) for x in (q, k, v)]
        sharded = jax.jit(lambda q, k, v, a: grad(q, k, v, a, "pallas"))
        text = sharded.lower(*args, jnp.float32(0.83)).as_text()
        got_grads, got_out = sharded(*args, jnp.float32(0.83))
    assert text.count("sdy.manual_computation") >= 2  # both kernels run per shard (forward and backward)
    for g, r in zip(jax.tree.leaves((got_grads, got_out)), jax.tree.leaves((ref_grads, ref_out))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-4, rtol=2e-4)
    assert got_out[0].sharding.spec == P(("data", "fsdp"), None, "tensor", None)


def _pallas_on_split_query_heads_equals_xla(attention, seed: int, t: int):
    """``attention(q, k, v, implementation)`` -> (out, lse) with 8 query heads split over a tensor
    axis of 4 and 2 KV heads (replicated): outputs and gradients equal the unsharded XLA path's.
    Returns the sharded output, whose sharding the caller may check."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    q, k, v = oracle.random_qkv(jax.random.PRNGKey(seed), 2, t, 8, 2, 8)

    def loss(q, k, v, impl):
        out, lse = attention(q, k, v, impl)
        return jnp.sum(out * out) + jnp.sum(jnp.sin(lse)), (out, lse)

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    ref_grads, ref_out = grad(q, k, v, "xla")
    with jax.set_mesh(mesh):
        q_s = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor", None)))
        kv_s = [jax.device_put(x, NamedSharding(mesh, P("data", None, None, None))) for x in (k, v)]
        got_grads, got_out = jax.jit(lambda q, k, v: grad(q, k, v, "pallas"))(q_s, *kv_s)
    for g, r in zip(jax.tree.leaves((got_grads, got_out)), jax.tree.leaves((ref_grads, ref_out))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-4, rtol=2e-4)
    return got_out[0]


def test_query_heads_split_over_the_tensor_axis_when_kv_heads_do_not_divide_it():
    """2 KV heads on a tensor axis of 4: each shard takes 2 of the 8 query heads and their one KV
    head (no replicated work), and computes the unsharded function, forward and backward."""
    ds = attended_distances(window=3, base="fibonacci", alpha=1.0, seq_len=40)
    out = _pallas_on_split_query_heads_equals_xla(lambda q, k, v, impl: offset_attention(q, k, v, distances=ds, implementation=impl, return_lse=True), 1, 40)
    assert out.sharding.spec == P("data", None, "tensor", None)  # query heads split, not replicated


def test_block_sparse_kernels_keep_a_kv_heads_query_heads_together():
    """Block-sparse attention chooses its blocks from the sum over a KV head's query heads, so
    under a tensor axis that does not divide the KV heads it must not split a group (each shard
    would choose from part of the sum): the sharded kernel equals the unsharded XLA path."""

    def attention(q, k, v, impl):
        return block_sparse_attention(q, k, v, block_size=4, num_blocks=3, return_lse=True, implementation=impl)

    _pallas_on_split_query_heads_equals_xla(attention, 2, 48)
