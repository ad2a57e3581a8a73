"""Rotary position embedding (RoPE) and its scalings: the model rotates q and k with it, and the
``sinks`` kind rotates its sink queries to StreamingLLM's cache positions. ``cfg`` is a
``fibjax.config.ModelConfig`` (read by its rope fields only, so this package imports no config).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def rope_frequencies(head_dim: int, cfg) -> tuple[np.ndarray, float]:
    """Inverse frequencies [E/2] and the attention temperature of ``cfg``'s RoPE and its scaling.

    none:   theta^(-2i/E).
    ntk:    the base raised so the lowest frequency stretches by ``factor`` (NTK-aware):
            theta' = theta * factor^(E / (E - 2)).
    linear: position interpolation, every frequency divided by ``factor``.
    yarn:   "NTK-by-parts" (Peng et al. 2023, eq. in sec. 3.2): with r_i = original_len / wavelength_i,
            frequencies with r_i < beta_slow (1) are interpolated (/ factor), those with r_i >
            beta_fast (32) kept, a linear ramp between; and the logits are scaled by
            (0.1 ln(factor) + 1)^2 (applied as that factor on both q and k).
    llama3: Llama 3.1's bands: with r_i = original_len / wavelength_i, frequencies with r_i <
            low_freq_factor are divided by ``factor``, those with r_i > high_freq_factor kept, a
            linear ramp in r_i between (Hugging Face's ``rope_type: llama3``); no temperature.
    """
    i = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    theta, factor = cfg.rope_theta, cfg.rope_factor
    if cfg.rope_scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = theta**-i
    if cfg.rope_scaling == "linear":
        inv_freq = inv_freq / factor
    mscale = 1.0
    if cfg.rope_scaling == "yarn":
        ratio = cfg.rope_original_len * inv_freq / (2 * np.pi)  # original length / wavelength
        keep = np.clip((ratio - YARN_BETA_SLOW) / (YARN_BETA_FAST - YARN_BETA_SLOW), 0.0, 1.0)
        inv_freq = (1 - keep) * inv_freq / factor + keep * inv_freq
        mscale = 0.1 * math.log(factor) + 1.0
    if cfg.rope_scaling == "llama3":
        ratio = cfg.rope_original_len * inv_freq / (2 * np.pi)
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        keep = np.clip((ratio - low) / (high - low), 0.0, 1.0)
        inv_freq = (1 - keep) * inv_freq / factor + keep * inv_freq
    return inv_freq.astype(np.float32), mscale


YARN_BETA_SLOW, YARN_BETA_FAST = 1.0, 32.0


def rope(x_BTHE: Array, positions_BT: Array, inv_freq_E2: np.ndarray, mscale: float = 1.0) -> Array:
    """Rotary embedding (rotate-half convention) at absolute positions, computed in float32."""
    angle_BTE2 = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_E2)
    cos, sin = jnp.cos(angle_BTE2)[:, :, None, :] * mscale, jnp.sin(angle_BTE2)[:, :, None, :] * mscale
    x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHE.dtype)
