"""The sharded train step, the optimizer, and the paper-size step lowered on 8 simulated devices for GPU/TPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax import sharding
from fibjax.config import AttentionConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from fibjax.model import Transformer, alpha_mask
from fibjax.recipes import MATRIX, attention, paper
from fibjax.train import step
from fibjax.train.optimizer import decay_mask, lr_schedule
from tests.helpers import EIGHT, check_sharded_as_the_rules_say, lower_on_eight_devices
from tests.tiers import first_fast


def tiny_cfg(**kw) -> TrainConfig:
    model = ModelConfig(
        vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, attention=AttentionConfig(kind="offset", alpha="learned", window=3)
    )
    return TrainConfig(steps=20, seq_len=32, global_batch=8, model=model, optim=OptimConfig(lr=1e-2, warmup_steps=2), **kw)


def run_steps(cfg: TrainConfig, devices, n=4):
    mesh = sharding.make_mesh(cfg.mesh, devices)
    trainer = step.build(cfg, mesh)
    state = trainer.init()
    batches = np.random.default_rng(0).integers(0, 128, (n, cfg.global_batch, cfg.seq_len + 1)).astype(np.int32)
    losses = []
    with jax.set_mesh(mesh):
        for b in batches:
            state, m = trainer.step(state, jax.device_put(b, trainer.batch_sharding))
            losses.append(float(m["loss"]))
    return losses, state


def test_eight_devices_match_one_device_and_really_shard():
    assert len(jax.devices()) == 8, "tests/conftest.py asks for 8 simulated CPU devices"
    one, _ = run_steps(tiny_cfg(mesh=MeshConfig(data=1)), jax.devices()[:1])
    eight, state = run_steps(tiny_cfg(mesh=MeshConfig(data=2, fsdp=2, tensor=2)), jax.devices())
    # Tolerance: the sharded step sums the loss and gradients in a different order (float32).
    np.testing.assert_allclose(eight, one, rtol=2e-5)
    assert one[-1] < one[0]
    kernel = state["params"]["blocks"][0]["mlp"]["gate"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (32, kernel.shape[1] // 2)
    mu = state["opt_state"][1][0].mu["blocks"][0]["mlp"]["gate"]["kernel"]
    assert mu.sharding.spec == kernel.sharding.spec  # optimizer moments are sharded like their parameter


def test_mesh_shape_fill_and_errors():
    assert sharding.mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 2)
    assert sharding.mesh_shape(MeshConfig(data=1, fsdp=-1), 8) == (1, 8, 1)
    with pytest.raises(ValueError, match="mesh"):
        sharding.mesh_shape(MeshConfig(data=3, fsdp=1, tensor=1), 8)
    with pytest.raises(ValueError, match="mesh"):
        sharding.mesh_shape(MeshConfig(data=-1, fsdp=3), 8)


def test_mesh_devices_takes_the_first_n_or_names_the_problem(monkeypatch):
    assert sharding.job_devices(MeshConfig()) == jax.devices()
    assert sharding.job_devices(MeshConfig(devices=3)) == jax.devices()[:3]
    assert sharding.make_mesh(MeshConfig(devices=2)).devices.tolist() == [[[d]] for d in jax.devices()[:2]]
    with pytest.raises(ValueError, match="mesh.devices=9, but 8 devices are available"):
        sharding.job_devices(MeshConfig(devices=9))
    with pytest.raises(ValueError, match=r"uses 8 devices, but 4 are available \(mesh.devices=4 of 8\)"):
        sharding.make_mesh(MeshConfig(data=8, devices=4))
    with pytest.raises(ValueError, match="^devices: must be >= 0"):
        MeshConfig(devices=-1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="a job of 2 processes uses every device"):
        sharding.job_devices(MeshConfig(devices=1))


def test_optimizer_masks_and_alpha_multiplier():
    params = {"blocks": {0: {"attn": {"alpha_logit": jnp.zeros(()), "q_proj": {"kernel": jnp.zeros((4, 4))}}, "attn_norm": {"scale": jnp.ones(4)}}}}
    assert decay_mask(params)["blocks"][0]["attn"]["q_proj"]["kernel"]
    assert not decay_mask(params)["blocks"][0]["attn"]["alpha_logit"] and not decay_mask(params)["blocks"][0]["attn_norm"]["scale"]
    # alphas are found by type (model.Alpha), not by name
    learned = Transformer(tiny_cfg().model, rngs=nnx.Rngs(0))
    mask = alpha_mask(learned)
    assert mask["blocks"][0]["attn"]["alpha_logit"] and not mask["blocks"][0]["attn"]["q_proj"]["kernel"]
    assert sum(jax.tree.leaves(mask)) == tiny_cfg().model.num_layers
    frozen = dataclasses.replace(tiny_cfg(mesh=MeshConfig(data=1)), optim=OptimConfig(lr=1e-2, warmup_steps=2, alpha_lr_multiplier=0.0))
    _, state = run_steps(frozen, jax.devices()[:1], n=2)
    assert float(state["params"]["blocks"][0]["attn"]["alpha_logit"]) == 0.0
    _, state = run_steps(tiny_cfg(mesh=MeshConfig(data=1)), jax.devices()[:1], n=2)
    assert float(state["params"]["blocks"][0]["attn"]["alpha_logit"]) != 0.0


def test_schedule_matches_the_reference():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, final_lr_ratio=0.1)
    s = lr_schedule(cfg, 110)
    assert float(s(0)) == pytest.approx(0.1)  # the first step already learns: lr * 1/warmup
    assert float(s(9)) == pytest.approx(1.0)
    assert float(s(109)) == pytest.approx(0.1, abs=1e-3)
    assert float(s(59)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-2)


def test_recipes_cover_the_paper_matrix():
    assert len(MATRIX) == 22 and len([n for n in MATRIX if n != "dense"]) == 21
    assert attention("fib_stagger_w12") == AttentionConfig(kind="offset", base="fibonacci", window=12, alpha="staggered")
    assert attention("pow2_fixed_w8").base == "pow2"
    with pytest.raises(ValueError, match="unknown model name"):
        attention("fib_sorted_w3")


@pytest.mark.parametrize("platform", first_fast(["cuda", "tpu"]))
def test_paper_size_step_lowers_for_accelerators(platform):
    """The 60M model at seq 1024, batch 32, on 8 devices, initialised abstractly.

    Lowering proves the program is well-formed and sharded as intended for that backend; it is
    not a compile and says nothing about speed or memory there (PLATFORM.md)."""
    trainer, lowered, batch = lower_on_eight_devices(dataclasses.replace(paper("fib_stagger_w12"), mesh=EIGHT), platform)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state["params"]))
    assert round(n_params / 1e6, 1) == 60.9
    check_sharded_as_the_rules_say(trainer, lowered, batch)


def test_sharded_step_compiles_and_splits_parameter_memory():
    """The paper's model, narrow (d_model 64, 2 of its 16 layers, its 8 heads and 2 KV heads),
    compiled for the 8 CPU devices: each holds a quarter (fsdp x tensor) of the parameters and
    of both Adam moments."""
    cfg = paper("fib_stagger_w12")
    cfg = dataclasses.replace(cfg, mesh=EIGHT, seq_len=64, global_batch=8, model=dataclasses.replace(cfg.model, d_model=64, num_layers=2, vocab_size=512))
    trainer, lowered, batch = lower_on_eight_devices(cfg)
    check_sharded_as_the_rules_say(trainer, lowered, batch)
    per_device = lowered.compile().memory_analysis().argument_size_in_bytes
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state["params"]))
    # the rest (norm scales split 2 ways, counters, this device's 2 rows of the batch) is < 1%
    assert per_device == pytest.approx(3 * total / 4, rel=0.01)
