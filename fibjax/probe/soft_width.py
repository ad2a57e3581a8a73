"""Stretch: a soft-width relaxation of the learned rungs, giving alpha a non-local gradient.

The interpolated path gives alpha a gradient only through frac, i.e. only when a target sits
within one position of a rung: a band 10 positions away is invisible to it. Here, during
training only, every learned layer attends densely with a log-bias over the distance delta:

    bias(delta) = log([0 <= delta <= W] + sum_k exp(-(delta - alpha f_k)^2 / (2 w^2)) + 1e-6)

(-inf for delta < 0): each rung is a Gaussian bump of width w around alpha * f_k. While w is
wide, a target many positions from every rung moves the loss through a bump's tail, so d loss /
d alpha is non-zero; w anneals to 0.5, where the bias is the hard attended set again. Scoring
uses the model's ordinary interpolated path at the alpha training reached, so any accuracy is
the sparse model's own. (The reference's ``spacing.py`` relaxes the same way.)

The forward runs the model's own submodules (as the decoder's layer modes do), and the step
reuses the Trainer's optimizer, ``step.split_batch`` and ``step.cross_entropy``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fibjax.attention import offsets
from fibjax.attention.common import group_queries, masked_softmax
from fibjax.model import Transformer
from fibjax.probe.tasks import ProbeError
from fibjax.train import step as train_step

FLOOR = 1e-6  # the bias far from every bump: log(1e-6) = -13.8


def width_at(step_index: int, steps: int, w0: float, w_end: float = 0.5, anneal: float = 0.8) -> float:
    """Linear from w0 to w_end over the first ``anneal`` of training, then w_end."""
    frac = min(1.0, step_index / max(anneal * steps, 1.0))
    return w0 + (w_end - w0) * frac


def distance_bias(seq_len: int, *, window: int, rungs, alpha, width) -> jax.Array:
    """[T, T] log-bias for query i, key j (delta = i - j); -inf where j > i."""
    delta_TT = jnp.asarray(np.subtract.outer(np.arange(seq_len), np.arange(seq_len)), jnp.float32)
    centres_R = alpha * jnp.asarray(rungs, jnp.float32)
    bumps_TT = jnp.exp(-0.5 * jnp.square((delta_TT[..., None] - centres_R) / width)).sum(-1)
    weight_TT = bumps_TT + ((delta_TT >= 0) & (delta_TT <= window)).astype(jnp.float32)
    return jnp.where(delta_TT >= 0, jnp.log(weight_TT + FLOOR), -jnp.inf)


def soft_attention(q_BTHE, k_BTKE, v_BTKE, bias_TT) -> jax.Array:
    """Dense causal attention with an additive [T, T] bias; float32 statistics."""
    b, t, h, e = q_BTHE.shape
    q_BTKGE = group_queries(q_BTHE, k_BTKE.shape[2])
    s_BKGTS = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BTKE, preferred_element_type=jnp.float32)
    p_BKGTS, _ = masked_softmax(s_BKGTS + bias_TT, jnp.isfinite(bias_TT))
    o_BTKGE = jnp.einsum("bkgts,bske->btkge", p_BKGTS, v_BTKE.astype(jnp.float32))
    return o_BTKGE.reshape(b, t, h, e).astype(q_BTHE.dtype)


def soft_forward(model: Transformer, tokens_BT, width) -> jax.Array:
    """Logits of ``model`` with every learned layer's rungs relaxed to bumps of ``width``."""
    cfg = model.cfg
    acfg = cfg.attention
    if not acfg.is_learned:
        raise ProbeError("the soft-width relaxation applies to learned alpha only")
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rungs = offsets.rung_slots(window=acfg.window, base=acfg.bounded_base, seq_len=t)
    x_BTD = model.lookup(tokens_BT)
    for block in model.blocks:
        attn = block.attn
        q, k, v = attn.qkv(block.attn_norm(x_BTD), positions_BT)
        bias_TT = distance_bias(t, window=acfg.window, rungs=rungs, alpha=attn.alpha(), width=width)
        x_BTD = x_BTD + attn.o_proj(soft_attention(q, k, v, bias_TT).reshape(b, t, -1))
        x_BTD = x_BTD + block.mlp(block.mlp_norm(x_BTD))
    return model.logits(x_BTD)


def make_step(trainer: train_step.Trainer):
    """(state, batch, width) -> (state, metrics): the Trainer's update on the relaxed forward."""
    graphdef, tx = trainer.graphdef, trainer.tx

    def loss_fn(params, batch, width):
        inputs_BT, targets_BT, weights_BT = train_step.split_batch(batch)
        return train_step.cross_entropy(soft_forward(nnx.merge(graphdef, params), inputs_BT, width), targets_BT, weights_BT)

    def step_fn(state, batch, width):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, width)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "alphas": train_step.learned_alphas(params)}
        return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return jax.jit(step_fn, donate_argnums=0)
