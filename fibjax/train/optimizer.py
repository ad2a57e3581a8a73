"""AdamW with warm-up + cosine, global-norm clipping, decay on matrices only, alpha lr multiplier."""

from __future__ import annotations

import jax
import optax

from fibjax.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The reference's schedule: lr * s / warmup for s = 1..warmup, then cosine from lr down to
    final_lr_ratio * lr at ``total_steps`` (s counts steps from 1, so the first step learns).

    Args:
        cfg: The optimizer's config.
        total_steps: The run's steps.

    Returns:
        The schedule (of optax's 0-based step count).
    """
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    inner = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.final_lr_ratio
    )
    return lambda count: inner(count + 1)


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2): not on norm scales or the alpha scalars (as the reference)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int, alpha_mask: optax.Params) -> optax.GradientTransformation:
    """``alpha_mask``: a tree of bools like the parameters, True at the learned alphas
    (``fibjax.model.alpha_mask``: found by their type, ``model.Alpha``).

    Args:
        cfg: The optimizer's config.
        total_steps: The run's steps.
        alpha_mask: True at the learned alphas.

    Returns:
        Global-norm clipping, AdamW, then the alphas' updates scaled by ``alpha_lr_multiplier``.
    """
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask),
        # the learned alpha scalars move at alpha_lr_multiplier x the lr
        optax.masked(optax.scale(cfg.alpha_lr_multiplier), alpha_mask),
    )
