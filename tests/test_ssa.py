"""Paper B: the SSA alignment loss, two-stream layers, training runs, paper-shape lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.config import AttentionConfig, ModelConfig, apply_overrides
from fibjax.model import SSAStreams, Transformer, ssa_alignment
from fibjax.recipes import ssa_cpu, ssa_paper
from fibjax.train import step
from fibjax.train.loop import train
from fibjax.train.metrics import read_metrics
from tests.helpers import EIGHT, TINY_SPARSE, check_sharded_as_the_rules_say, lower_on_eight_devices
from tests.tiers import first_fast


def test_alignment_terms_on_a_hand_built_case():
    full, sparse = jnp.array([0.0, 2.0]), jnp.array([0.5, 0.0])
    # |d| = 0.5 -> 0.5 * 0.25 = 0.125; |d| = 2 -> 2 - 0.5 = 1.5; mean 0.8125 per term, two terms
    np.testing.assert_allclose(ssa_alignment(full, sparse), 1.625)
    g_full, g_sparse = jax.grad(ssa_alignment, argnums=(0, 1))(full, sparse)
    # only the sparsity term reaches full, only the commitment term reaches sparse
    np.testing.assert_allclose(g_full, [-0.25, 0.5])
    np.testing.assert_allclose(g_sparse, [0.25, -0.5])
    g_full_only = jax.grad(lambda f: ssa_alignment(f, jax.lax.stop_gradient(sparse)))(full)
    np.testing.assert_allclose(g_full_only, g_full)  # stopping sparse changes nothing for full: sg was already there


def tiny_model(kind="dense"):
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attention=AttentionConfig(kind=kind, block_size=8, num_blocks=2, window=2, alpha="staggered"),
    )


@pytest.mark.parametrize("sparse_kind", first_fast(["offset", "block_sparse"]))
def test_two_stream_layers_pass_on_only_the_chosen_stream(sparse_kind):
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 48), 0, 64)
    dense_model = Transformer(tiny_model("dense"), rngs=nnx.Rngs(0))
    sparse_model = Transformer(tiny_model(sparse_kind), rngs=nnx.Rngs(0))
    sparse_cfg = tiny_model(sparse_kind).attention
    for use_sparse, reference in ((True, sparse_model), (False, dense_model)):
        out, sown = nnx.capture(dense_model, nnx.Intermediate)(tokens, ssa=SSAStreams(sparse_cfg, jnp.asarray(use_sparse)))
        np.testing.assert_allclose(out, reference(tokens), rtol=1e-5, atol=1e-5)
        aligns = jax.tree.leaves(sown)
        assert len(aligns) == 2 and all(float(a) > 0 for a in aligns)

    # with the alignment weight at 0, the gradient is the chosen stream's CE gradient
    def ce(params, model_cfg, ssa):
        m = nnx.merge(nnx.graphdef(Transformer(model_cfg, rngs=nnx.Rngs(0))), params)
        logits, _ = nnx.capture(m, nnx.Intermediate)(tokens[:, :-1], ssa=ssa)
        return step.cross_entropy(logits, tokens[:, 1:])

    params = nnx.to_pure_dict(nnx.state(dense_model, nnx.Param))
    g_ssa = jax.grad(ce)(params, tiny_model("dense"), SSAStreams(sparse_cfg, jnp.asarray(True)))
    g_sparse = jax.grad(ce)(params, tiny_model(sparse_kind), None)
    for a, b in zip(jax.tree.leaves(g_ssa), jax.tree.leaves(g_sparse)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


SMALL = [*TINY_SPARSE, "steps=30", "checkpoint.every_steps=30"]


@pytest.mark.parametrize("method", first_fast(["ssa", "fullattn", "moba", "ssa_fib"]))
def test_short_cpu_runs_learn_and_log_alignment(method, data_dir, tmp_path):
    cfg = apply_overrides(ssa_cpu(method), [*SMALL, f"data.path={data_dir}", "data.weights="])
    result = train(cfg, tmp_path / method, progress=False)
    assert np.mean(result.losses[-5:]) < np.mean(result.losses[:5]) - 0.5
    rows = read_metrics(tmp_path / method)
    if method.startswith("ssa"):
        assert all("align" in r and "ce" in r for r in rows)
        streams = [r["sparse_stream"] for r in rows]
        assert 0 < sum(streams) < len(streams)  # both streams were drawn
    else:
        assert not any("align" in r for r in rows)


def test_stream_choice_is_reproducible(data_dir, tmp_path):
    cfg = apply_overrides(ssa_cpu("ssa"), [*SMALL, "steps=6", f"data.path={data_dir}", "data.weights="])
    train(cfg, tmp_path / "a", progress=False)
    train(cfg, tmp_path / "b", progress=False)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["sparse_stream"] for r in a] == [r["sparse_stream"] for r in b] and [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.parametrize("method", ["ssa", "moba"])
@pytest.mark.parametrize("platform", first_fast(["cuda", "tpu"]))
def test_paper_shape_initialises_abstractly_and_lowers(method, platform):
    """The Llama-3.2-1B shape at 8k tokens, lowered on 8 devices (data 2 x fsdp 2 x tensor 2):
    sharded by the rules, with SSA's alignment term beside the loss."""
    cfg = dataclasses.replace(ssa_paper(method), mesh=EIGHT, global_batch=4)
    trainer, lowered, batch = lower_on_eight_devices(cfg, platform)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state["params"]))
    assert 1.1e9 < n_params < 1.3e9  # Llama-3.2-1B shape with 2 KV heads and a tied embedding
    check_sharded_as_the_rules_say(trainer, lowered, batch)
    metrics = lowered.out_info[1]
    assert ("align" in metrics) == (method == "ssa") and all(metrics[k].shape == () for k in ("loss", "ce", "grad_norm"))
