"""The train state, its sharded creation, the loss, and the jitted train step.

The state is a plain dict of arrays (``step``, ``params``, ``opt_state``, ``rng``) so that
jit shardings, donation and Orbax see ordinary pytrees. Parameters are created inside jit
under sharding constraints from the logical-axis rules, and the optimizer state inherits
them, so no device ever holds a full copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from fibjax import sharding
from fibjax.attention.alpha import PARAM, logit_to_alpha
from fibjax.config import TrainConfig
from fibjax.model import SSAStreams, Transformer, alpha_mask
from fibjax.train.optimizer import make_optimizer

State = dict[str, Any]


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array | None = None) -> jax.Array:
    """Mean next-token negative log-likelihood in float32 from logits; with ``weights`` the
    weighted mean (a probe reads its loss only where the weights are non-zero). The model's own
    loss is ``fibjax.model.chunked_nll`` (the same numbers, the logits never whole)."""
    nll_BT = optax.losses.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    return mean_nll(nll_BT, weights_BT)


def mean_nll(nll_BT: jax.Array, weights_BT: jax.Array | None = None) -> jax.Array:
    """The mean of per-token NLL, or its ``weights``-weighted mean."""
    if weights_BT is None:
        return jnp.mean(nll_BT)
    w_BT = weights_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1e-9)


def split_batch(batch) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(inputs, targets, weights) of a batch: token windows [B, T+1] (the language model: predict
    the next token everywhere), or a dict with ``inputs``, ``targets`` and ``weights``, all [B, T]
    (a synthetic task with its own targets and loss positions, e.g. ``fibjax.probe``)."""
    if isinstance(batch, dict):
        return batch["inputs"], batch["targets"], batch["weights"]
    return batch[:, :-1], batch[:, 1:], None


@dataclass
class Trainer:
    """Everything jitted for one config on one mesh: init, step, and their shardings."""

    cfg: TrainConfig
    mesh: Mesh
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    init: Callable[[], State]
    step: Callable[[State, jax.Array], tuple[State, dict]]
    abstract_state: State  # ShapeDtypeStructs carrying their shardings (for restore)
    batch_sharding: jax.sharding.NamedSharding
    val_loss: Callable[[dict, jax.Array], jax.Array]  # (params, tokens [B, T+1]) -> mean NLL, full attention path of the model


def build(cfg: TrainConfig, mesh: Mesh) -> Trainer:
    """The [Trainer][fibjax.train.Trainer] of ``cfg`` on ``mesh``: the jitted init and step built from
    the abstract model (nothing is allocated until ``init`` runs), the state sharded from the start.

    Args:
        cfg: The config.
        mesh: The device mesh.

    Returns:
        The Trainer.
    """
    abstract_model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    param_shardings = sharding.param_shardings(abstract_params, mesh)
    tx = make_optimizer(cfg.optim, cfg.steps, alpha_mask(abstract_model))

    abstract_opt_state = jax.eval_shape(tx.init, nnx.to_pure_dict(abstract_params))
    # moments follow their parameter's sharding; counters and the like are replicated
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, param_shardings, transform_non_params=lambda _: sharding.replicated(mesh))
    state_shardings = {"step": sharding.replicated(mesh), "params": param_shardings, "opt_state": opt_shardings, "rng": sharding.replicated(mesh)}

    def init_fn() -> State:
        params = nnx.to_pure_dict(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param))
        return {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params), "rng": jax.random.key_data(jax.random.PRNGKey(cfg.seed))}

    init_jit = jax.jit(init_fn, out_shardings=state_shardings)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(init_fn), state_shardings)

    sparse_stream = cfg.sparse_stream

    def loss_fn(params, batch, rng, step):
        model = nnx.merge(graphdef, params)
        inputs_BT, targets_BT, weights_BT = split_batch(batch)
        if sparse_stream is None:  # the model returns per-token NLL (logits_chunk bounds the logits' memory)
            ce = mean_nll(model(inputs_BT, targets_BT=targets_BT), weights_BT)
            return ce, {"ce": ce}
        # SSA: one stream for the whole step, drawn from the run's key and the step number,
        # so the choice is reproducible and survives a resume.
        use_sparse = jax.random.bernoulli(jax.random.fold_in(jax.random.wrap_key_data(rng), step), cfg.ssa.sparse_prob)
        nll_BT, sown = nnx.capture(model, nnx.Intermediate)(inputs_BT, ssa=SSAStreams(sparse_stream, use_sparse), targets_BT=targets_BT)
        ce = mean_nll(nll_BT, weights_BT)
        align = jnp.mean(jnp.stack(jax.tree.leaves(sown)))  # averaged over layers
        return ce + cfg.ssa.align_weight * align, {"ce": ce, "align": align, "sparse_stream": use_sparse.astype(jnp.float32)}

    def step_fn(state: State, batch):
        """``batch``: token windows [B, T+1], or a dict of inputs/targets/weights (``split_batch``)."""
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, state["rng"], state["step"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "alphas": learned_alphas(params), **aux}
        return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    def val_loss_fn(params, tokens_BT1):
        return mean_nll(nnx.merge(graphdef, params)(tokens_BT1[:, :-1], targets_BT=tokens_BT1[:, 1:]))

    batch_sharding = sharding.batch_sharding(mesh)
    step_jit = jax.jit(step_fn, in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
    val_jit = jax.jit(val_loss_fn, in_shardings=(param_shardings, batch_sharding), out_shardings=sharding.replicated(mesh))
    return Trainer(cfg, mesh, graphdef, tx, init_jit, step_jit, abstract_state, batch_sharding, val_jit)


def learned_alphas(params) -> dict[str, jax.Array]:
    """{"layer_3": alpha} for every learned layer (alpha = 0.5 + sigmoid(alpha_logit))."""
    return {f"layer_{i}": logit_to_alpha(block["attn"][PARAM]) for i, block in params["blocks"].items() if PARAM in block["attn"]}
