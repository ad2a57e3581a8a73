"""The decoder-only LM (Flax NNX): RMSNorm pre-norm, SwiGLU, RoPE, GQA, tied embeddings.

Attention per layer comes from :class:`fibjax.config.AttentionConfig`. The model has no
length-dependent parameters: static offsets and pow2 rungs are derived from the length a
call runs at, so the same weights run at 1x, 2x or 4x the training length.

Parameters carry logical axis names (metadata ``logical_axes``); ``fibjax.train.sharding``
maps them to mesh axes. Letters: B batch, T sequence, D d_model, H/K query/KV heads,
E head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fibjax import attention as attn_lib
from fibjax.attention import offsets
from fibjax.config import AttentionConfig, ModelConfig

Array = jax.Array


def _init(std: float, axes: tuple[str | None, ...]):
    return nnx.with_metadata(nnx.initializers.normal(std), logical_axes=axes)


def rope_frequencies(head_dim: int, cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [E/2] and the attention temperature of ``cfg``'s RoPE and its scaling.

    none:   theta^(-2i/E).
    ntk:    the base raised so the lowest frequency stretches by ``factor`` (NTK-aware):
            theta' = theta * factor^(E / (E - 2)).
    linear: position interpolation, every frequency divided by ``factor``.
    yarn:   "NTK-by-parts" (Peng et al. 2023, eq. in sec. 3.2): with r_i = original_len / wavelength_i,
            frequencies with r_i < beta_slow (1) are interpolated (/ factor), those with r_i >
            beta_fast (32) kept, a linear ramp between; and the logits are scaled by
            (0.1 ln(factor) + 1)^2 (applied as that factor on both q and k).
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
    return inv_freq.astype(np.float32), mscale


YARN_BETA_SLOW, YARN_BETA_FAST = 1.0, 32.0


def rope(x_BTHE: Array, positions_BT: Array, inv_freq_E2: np.ndarray, mscale: float = 1.0) -> Array:
    """Rotary embedding (rotate-half convention) at absolute positions, computed in float32."""
    angle_BTE2 = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_E2)
    cos, sin = jnp.cos(angle_BTE2)[:, :, None, :] * mscale, jnp.sin(angle_BTE2)[:, :, None, :] * mscale
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


def theta_to_alpha(theta: Array) -> Array:
    """A learned layer's alpha, 0.5 + sigmoid(theta): always inside (0.5, 1.5)."""
    return offsets.ALPHA_MIN + jax.nn.sigmoid(theta)


class SSAStreams(NamedTuple):
    """Paper B training: run both streams, pass on the sparse one iff ``use_sparse`` (traced)."""

    sparse: AttentionConfig
    use_sparse: Array


def smooth_l1(a: Array, b: Array) -> Array:
    """Mean Huber loss with beta = 1 (torch's SmoothL1Loss default, as the SSA reference)."""
    d = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5))


def ssa_alignment(full_BTHE: Array, sparse_BTHE: Array) -> Array:
    """SmoothL1(full, sg(sparse)) (full learns to be sparse) + SmoothL1(sg(full), sparse)
    (sparse stays near full), on per-head attention outputs before the output projection."""
    sg = jax.lax.stop_gradient
    return smooth_l1(full_BTHE, sg(sparse_BTHE)) + smooth_l1(sg(full_BTHE), sparse_BTHE)


class Attention(nnx.Module):
    """Projections, RoPE, and the layer's attention path (dense, offsets, or blocks).

    Optional extras, recorded with ``sow`` as ``nnx.Intermediate``: the SSA alignment loss
    (``ssa_align``) and the dropped attention mass against dense attention (``dropped_mass``).
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        std, out_std = d**-0.5, d**-0.5 / math.sqrt(2 * cfg.num_layers)
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d, h * e, kernel_init=_init(std, ("embed", "heads")), **lin)
        self.k_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **lin)
        self.v_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **lin)
        self.o_proj = nnx.Linear(h * e, d, kernel_init=_init(out_std, ("heads", "embed")), **lin)
        if cfg.attention.is_learned:
            alpha0 = cfg.attention.layer_alphas(cfg.num_layers)[layer]
            self.theta = nnx.Param(jnp.asarray(offsets.alpha_to_theta(alpha0), jnp.float32), logical_axes=())

    def alpha(self, acfg: AttentionConfig | None = None) -> Array | float | None:
        """This layer's alpha under ``acfg`` (default: the model's): 0.5 + sigmoid(theta) when
        learned, the schedule's value for static offsets, None otherwise."""
        acfg = acfg or self.cfg.attention
        if acfg.kind != "offset":
            return None
        if acfg.is_learned:
            return theta_to_alpha(self.theta[...])
        return acfg.layer_alphas(self.cfg.num_layers)[self.layer]

    def qkv(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
        b, t, _ = x_BTD.shape
        e = self.cfg.resolved_head_dim
        q_BTHE = self.q_proj(x_BTD).reshape(b, t, self.cfg.num_heads, e)
        k_BTKE = self.k_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        v_BTKE = self.v_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        inv_freq, mscale = rope_frequencies(e, self.cfg)
        return rope(q_BTHE, positions_BT, inv_freq, mscale), rope(k_BTKE, positions_BT, inv_freq, mscale), v_BTKE

    def attend(self, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array, acfg: AttentionConfig | None = None, *, return_lse: bool = False):
        """The attention output [B,T,H,E] (and lse) under ``acfg`` (default: the model's)."""
        acfg = acfg or self.cfg.attention
        t, impl = q_BTHE.shape[1], acfg.implementation
        if acfg.kind == "dense":
            return attn_lib.dense_attention(q_BTHE, k_BTKE, v_BTKE, return_lse=return_lse)
        if acfg.kind == "block_sparse":
            return attn_lib.block_sparse_attention(q_BTHE, k_BTKE, v_BTKE, block_size=acfg.block_size, num_blocks=acfg.num_blocks, return_lse=return_lse)
        if acfg.is_interpolated:
            return attn_lib.interpolated_attention(q_BTHE, k_BTKE, v_BTKE, window=acfg.window, base=acfg.bounded_base, alpha=self.alpha(acfg),
                                                   return_lse=return_lse, implementation=impl)
        ds = offsets.attended_distances(window=acfg.window, base=acfg.bounded_base, alpha=self.alpha(acfg), seq_len=t)
        return attn_lib.offset_attention(q_BTHE, k_BTKE, v_BTKE, distances=ds, return_lse=return_lse, implementation=impl)

    def __call__(self, x_BTD: Array, positions_BT: Array, *, ssa: SSAStreams | None = None, probe_dropped_mass: bool = False) -> Array:
        b, t, _ = x_BTD.shape
        q, k, v = self.qkv(x_BTD, positions_BT)
        if ssa is not None:
            full_BTHE, sparse_BTHE = self.attend(q, k, v, AttentionConfig(kind="dense")), self.attend(q, k, v, ssa.sparse)
            self.sow(nnx.Intermediate, "ssa_align", ssa_alignment(full_BTHE, sparse_BTHE))
            out_BTHE = jnp.where(ssa.use_sparse, sparse_BTHE, full_BTHE)  # only the chosen stream is passed on
        elif probe_dropped_mass:
            out_BTHE, lse_BTH = self.attend(q, k, v, return_lse=True)
            _, full_lse_BTH = attn_lib.dense_attention(q, k, v, return_lse=True)
            self.sow(nnx.Intermediate, "dropped_mass", attn_lib.dropped_mass(lse_BTH, full_lse_BTH))
        else:
            out_BTHE = self.attend(q, k, v)
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

    def __call__(self, x_BTD: Array, positions_BT: Array, ssa: SSAStreams | None = None, probe_dropped_mass: bool = False) -> Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, ssa=ssa, probe_dropped_mass=probe_dropped_mass)
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

    def __call__(self, tokens_BT: Array, positions_BT: Array | None = None, *, ssa: SSAStreams | None = None,
                 probe_dropped_mass: bool = False, targets_BT: Array | None = None) -> Array:
        """Logits [B, T, V] float32; with ``targets_BT``, the per-token NLL [B, T] float32 instead,
        computed ``cfg.logits_chunk`` positions at a time so the full logits never exist.
        ``ssa``: run SSA's two streams (training); ``probe_dropped_mass``: record every layer's
        dropped attention mass against dense attention (evaluation)."""
        x_BTD = self.hidden(tokens_BT, positions_BT, ssa=ssa, probe_dropped_mass=probe_dropped_mass)
        if targets_BT is None:
            return self.logits(x_BTD)
        return chunked_nll(self.final_norm(x_BTD), self.embed.embedding[...], targets_BT, self.cfg.logits_chunk)

    def hidden(self, tokens_BT: Array, positions_BT: Array | None = None, *, ssa: SSAStreams | None = None,
               probe_dropped_mass: bool = False) -> Array:
        """The residual stream after the last block [B, T, D] (before the final norm)."""
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x_BTD = self.embed(tokens_BT)

        def run_block(block: Block, x_BTD: Array) -> Array:
            return block(x_BTD, positions_BT, ssa, probe_dropped_mass)

        if self.cfg.remat:  # one extra forward per block instead of storing its activations
            run_block = nnx.remat(run_block)
        for block in self.blocks:
            x_BTD = run_block(block, x_BTD)
        return x_BTD

    def logits(self, x_BTD: Array) -> Array:
        """Final norm and the tied output projection, accumulated and returned in float32 even
        when the model computes in bf16 (the loss and every perplexity come from these)."""
        return _logits(self.final_norm(x_BTD), self.embed.embedding[...])

    def alphas(self) -> list[float | Array | None]:
        """Per-layer alpha (None for layers without one)."""
        return [block.attn.alpha() for block in self.blocks]


def _logits(x_BTD: Array, table_VD: Array) -> Array:
    return jnp.einsum("btd,vd->btv", x_BTD, table_VD.astype(x_BTD.dtype), preferred_element_type=jnp.float32)


def _nll(x_BTD: Array, table_VD: Array, targets_BT: Array) -> Array:
    logits_BTV = _logits(x_BTD, table_VD)
    picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BTV, axis=-1) - picked_BT


def chunked_nll(x_BTD: Array, table_VD: Array, targets_BT: Array, chunk: int) -> Array:
    """Per-token NLL [B, T] float32 of the normed stream ``x`` under the tied output projection,
    ``chunk`` positions at a time (0: all at once). Each chunk is rematerialised in the backward
    pass (jax.checkpoint inside lax.map), so at most one chunk of [B, chunk, V] logits is alive
    in training as in evaluation: at paper B's vocabulary (128,256) and 8,192 tokens the full
    logits would be 4 GB per sequence. The numbers are the unchunked ones (tested)."""
    b, t, d = x_BTD.shape
    if chunk <= 0 or chunk >= t:
        return _nll(x_BTD, table_VD, targets_BT)
    n = -(-t // chunk)
    pad = n * chunk - t
    x_NBCD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
    y_NBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    one = jax.checkpoint(lambda xy: _nll(xy[0], table_VD, xy[1]))
    nll_NBC = jax.lax.map(one, (x_NBCD, y_NBC))
    return nll_NBC.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


@functools.lru_cache(maxsize=32)
def graphdef_of(cfg: ModelConfig) -> nnx.GraphDef:
    """The structure of a Transformer for ``cfg`` (no parameters allocated); with a params dict,
    ``nnx.merge(graphdef_of(cfg), params)`` is the model."""
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
