"""The decoder-only LM (Flax NNX): RMSNorm pre-norm, SwiGLU, RoPE, GQA, tied embeddings.

Attention per layer comes from :class:`fibjax.config.AttentionConfig`. The model has no
length-dependent parameters: static offsets and pow2 rungs are derived from the length a
call runs at, so the same weights run at 1x, 2x or 4x the training length.

Parameters carry logical axis names (metadata ``logical_axes``); ``fibjax.train.sharding``
maps them to mesh axes. Letters: B batch, T sequence, D d_model, H/K query/KV heads,
E head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from fibjax import attention as attn_lib
from fibjax.attention import offsets
from fibjax.config import ModelConfig

Array = jax.Array


def _init(std: float, axes: tuple[str | None, ...]):
    return nnx.with_metadata(nnx.initializers.normal(std), logical_axes=axes)


def rope(x_BTHE: Array, positions_BT: Array, theta: float) -> Array:
    """Rotary embedding (rotate-half convention) at absolute positions, computed in float32."""
    e = x_BTHE.shape[-1]
    inv_freq_E2 = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    angle_BTE2 = positions_BT.astype(jnp.float32)[..., None] * inv_freq_E2
    cos, sin = jnp.cos(angle_BTE2)[:, :, None, :], jnp.sin(angle_BTE2)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHE.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("embed",))

    def __call__(self, x_BTD: Array) -> Array:
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(x_BTD.dtype)


class Attention(nnx.Module):
    """Projections, RoPE, and the layer's attention path (dense, static offsets, or learned)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        std, out_std = d**-0.5, d**-0.5 / math.sqrt(2 * cfg.num_layers)
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d, h * e, kernel_init=_init(std, ("embed", "heads")), **lin)
        self.k_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **lin)
        self.v_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **lin)
        self.o_proj = nnx.Linear(h * e, d, kernel_init=_init(out_std, ("heads", "embed")), **lin)
        acfg = cfg.attention
        self.alpha_init = acfg.layer_alphas(cfg.num_layers)[layer] if acfg.kind == "offset" else None
        if acfg.is_learned:
            theta0 = offsets.alpha_to_theta(self.alpha_init)
            self.theta = nnx.Param(jnp.asarray(theta0, jnp.float32), logical_axes=())

    def alpha(self) -> Array | float | None:
        """This layer's alpha: 0.5 + sigmoid(theta) when learned, the schedule's value otherwise."""
        if self.cfg.attention.is_learned:
            return offsets.ALPHA_MIN + jax.nn.sigmoid(self.theta[...])
        return self.alpha_init

    def qkv(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
        b, t, _ = x_BTD.shape
        e = self.cfg.resolved_head_dim
        q_BTHE = self.q_proj(x_BTD).reshape(b, t, self.cfg.num_heads, e)
        k_BTKE = self.k_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        v_BTKE = self.v_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        theta = self.cfg.rope_theta
        return rope(q_BTHE, positions_BT, theta), rope(k_BTKE, positions_BT, theta), v_BTKE

    def attend(self, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array) -> Array:
        acfg, t = self.cfg.attention, q_BTHE.shape[1]
        if acfg.kind == "dense":
            return attn_lib.dense_attention(q_BTHE, k_BTKE, v_BTKE)
        if acfg.kind == "offset" and acfg.is_learned:
            return attn_lib.interpolated_attention(q_BTHE, k_BTKE, v_BTKE, window=acfg.window, base=acfg.base, alpha=self.alpha())
        if acfg.kind == "offset":
            ds = offsets.attended_distances(window=acfg.window, base=acfg.base, alpha=self.alpha_init, seq_len=t)
            return attn_lib.offset_attention(q_BTHE, k_BTKE, v_BTKE, distances=ds)
        raise NotImplementedError(f"attention kind {acfg.kind!r} is not available in this build")

    def __call__(self, x_BTD: Array, positions_BT: Array) -> Array:
        b, t, _ = x_BTD.shape
        out_BTHE = self.attend(*self.qkv(x_BTD, positions_BT))
        return self.o_proj(out_BTHE.reshape(b, t, -1))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.resolved_mlp_hidden
        std, out_std = d**-0.5, d**-0.5 / math.sqrt(2 * cfg.num_layers)
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.gate = nnx.Linear(d, f, kernel_init=_init(std, ("embed", "mlp")), **lin)
        self.up = nnx.Linear(d, f, kernel_init=_init(std, ("embed", "mlp")), **lin)
        self.down = nnx.Linear(f, d, kernel_init=_init(out_std, ("mlp", "embed")), **lin)

    def __call__(self, x_BTD: Array) -> Array:
        return self.down(jax.nn.silu(self.gate(x_BTD)) * self.up(x_BTD))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD: Array, positions_BT: Array) -> Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Transformer(nnx.Module):
    """Token ids [B, T] -> logits [B, T, V] (float32)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=_init(cfg.d_model**-0.5, ("vocab", "embed")), rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)

    def __call__(self, tokens_BT: Array, positions_BT: Array | None = None) -> Array:
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x_BTD = self.embed(tokens_BT)
        # remat trades one extra forward per block for not storing its activations
        run_block = nnx.remat(Block.__call__) if self.cfg.remat else Block.__call__
        for block in self.blocks:
            x_BTD = run_block(block, x_BTD, positions_BT)
        x_BTD = self.final_norm(x_BTD)
        return self.embed.attend(x_BTD).astype(jnp.float32)

    def alphas(self) -> list[float | Array | None]:
        """Per-layer alpha (None for layers without one)."""
        return [block.attn.alpha() for block in self.blocks]


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
