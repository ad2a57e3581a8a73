"""The decoder-only LM (Flax NNX): RMSNorm pre-norm, SwiGLU, RoPE, GQA, tied (or untied) embeddings.

Attention per layer comes from [AttentionConfig][fibjax.config.AttentionConfig]. The model has no
length-dependent parameters: static offsets and pow2 rungs are derived from the length a
call runs at, so the same weights run at 1x, 2x or 4x the training length.

Parameters carry logical axis names (metadata ``logical_axes``); ``fibjax.sharding``
maps them to mesh axes. Letters: B batch, T sequence, D d_model, H/K query/KV heads,
E head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from fibjax import kinds
from fibjax.attention.rope import YARN_BETA_FAST, YARN_BETA_SLOW, rope, rope_frequencies  # noqa: F401  (public names of fibjax.model)
from fibjax.attention.sharded import HEAD_AXIS, batch_axes
from fibjax.config import AttentionConfig, ModelConfig
from fibjax.kinds.interpolated import Alpha
from fibjax.layer_modes import DroppedMassProbe, SSAStreams, smooth_l1, ssa_alignment  # noqa: F401  (public names of fibjax.model)

Array = jax.Array
# (attention layer, q [B,T,H,E], k, v [B,T,K,E], x [B,T,D]) -> output [B,T,H,E]: fibjax.layer_modes
LayerMode = Callable[..., Array]


def _init(std: float, axes: tuple[str | None, ...]):
    return nnx.with_metadata(nnx.initializers.normal(std), logical_axes=axes)


class RMSNorm(nnx.RMSNorm):
    """``nnx.RMSNorm`` normalising in float32 and returning the input's dtype: one rounding in
    bf16 (nnx's own bf16 path rounds before the scale, 1 ulp off in a quarter of the entries)."""

    def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        ones = nnx.with_metadata(nnx.initializers.ones_init(), logical_axes=("embed",))
        super().__init__(dim, epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype, scale_init=ones, rngs=rngs)

    def __call__(self, x_BTD: Array) -> Array:
        return super().__call__(x_BTD).astype(x_BTD.dtype)


def alpha_mask(model: nnx.Module) -> dict:
    """Pure dict of bools, like the model's parameters: True at its learned alphas (``Alpha``)."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.to_pure_dict(jax.tree.map(lambda v: isinstance(v, Alpha), nnx.state(model, nnx.Param), is_leaf=is_var))


def _with_bias(lin: dict, use_bias: bool, axis: str) -> dict:
    """``nnx.Linear`` keywords with a zero-initialised bias along ``axis`` when ``use_bias``."""
    if not use_bias:
        return lin
    return {**lin, "use_bias": True, "bias_init": nnx.with_metadata(nnx.initializers.zeros_init(), logical_axes=(axis,))}


class Attention(nnx.Module):
    """Projections, RoPE, and the layer's attention, run by its kind (``fibjax.kinds``): the kind
    adds its parameters to this module (a learned alpha, NSA's gates) and computes the attention.

    A ``mode`` (``fibjax.layer_modes``: SSA's two streams, the dropped-mass probe; the decoder's
    prompt and token steps) replaces the plain attention call when given; it records its extras
    with ``sow``."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        std, out_std = d**-0.5, d**-0.5 / math.sqrt(2 * cfg.num_layers)
        lin = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d, h * e, kernel_init=_init(std, ("embed", "heads")), **_with_bias(lin, cfg.qkv_bias, "heads"))
        self.k_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **_with_bias(lin, cfg.qkv_bias, "kv_heads"))
        self.v_proj = nnx.Linear(d, k * e, kernel_init=_init(std, ("embed", "kv_heads")), **_with_bias(lin, cfg.qkv_bias, "kv_heads"))
        self.o_proj = nnx.Linear(h * e, d, kernel_init=_init(out_std, ("heads", "embed")), **lin)
        owners = [kinds.kind_of(cfg.attention)]
        if cfg.attention.nsa_params and kinds.get("nsa") not in owners:  # SSA with an NSA sparse stream: the dense layer carries its parameters
            owners.append(kinds.get("nsa"))
        for kind in owners:
            for name, value in kind.params(cfg, layer, rngs).items():
                setattr(self, name, value)

    def alpha(self, acfg: AttentionConfig | None = None) -> Array | float | None:
        """This layer's alpha under ``acfg`` (default: the model's): 0.5 + sigmoid(alpha_logit) when
        learned, the schedule's value for static offsets, None for kinds without alpha."""
        acfg = acfg or self.cfg.attention
        return kinds.kind_of(acfg).alpha(self, acfg)

    def qkv(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
        b, t, _ = x_BTD.shape
        e = self.cfg.resolved_head_dim
        q_BTHE = self.q_proj(x_BTD).reshape(b, t, self.cfg.num_heads, e)
        k_BTKE = self.k_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        v_BTKE = self.v_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, e)
        inv_freq, mscale = rope_frequencies(e, self.cfg)
        return rope(q_BTHE, positions_BT, inv_freq, mscale), rope(k_BTKE, positions_BT, inv_freq, mscale), v_BTKE

    def attend(self, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array, acfg: AttentionConfig | None = None, *, x_BTD: Array | None = None, return_lse: bool = False):
        """The attention output [B,T,H,E] (and lse) under ``acfg`` (default: the model's);
        ``x_BTD``, the layer's normed input, makes NSA's gates."""
        acfg = acfg or self.cfg.attention
        return kinds.kind_of(acfg).attend(self, q_BTHE, k_BTKE, v_BTKE, acfg, x_BTD=x_BTD, return_lse=return_lse)

    def __call__(self, x_BTD: Array, positions_BT: Array, mode: LayerMode | None = None) -> Array:
        b, t, _ = x_BTD.shape
        q, k, v = self.qkv(x_BTD, positions_BT)
        out_BTHE = self.attend(q, k, v, x_BTD=x_BTD) if mode is None else mode(self, q, k, v, x_BTD)
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
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD: Array, positions_BT: Array, mode: LayerMode | None = None) -> Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, mode)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Transformer(nnx.Module):
    """Token ids [B, T] -> logits [B, T, V] (float32).

    Args:
        cfg: The model's config.
        rngs: The random streams its parameters are initialised from.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, embedding_init=_init(cfg.d_model**-0.5, ("vocab", "embed")), rngs=rngs
        )
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, rngs=rngs)
        if not cfg.tie_embeddings:  # an output matrix of its own, [V, D] like the embedding table
            table_VD = nnx.initializers.normal(cfg.d_model**-0.5)(rngs.params(), (cfg.vocab_size, cfg.d_model), cfg.param_dtype)
            self.lm_head = nnx.Param(table_VD, logical_axes=("vocab", "embed"))

    def __call__(
        self,
        tokens_BT: Array,
        positions_BT: Array | None = None,
        *,
        ssa: SSAStreams | None = None,
        probe_dropped_mass: bool = False,
        mode: LayerMode | None = None,
        targets_BT: Array | None = None,
    ) -> Array:
        """Logits [B, T, V] float32; with ``targets_BT``, the per-token NLL [B, T] float32 instead,
        computed ``cfg.logits_chunk`` positions at a time so the full logits never exist.
        ``ssa``: run SSA's two streams (training); ``probe_dropped_mass``: record every layer's
        dropped attention mass against dense attention (evaluation); ``mode``: any layer mode.

        Args:
            tokens_BT: Token ids [B, T].
            positions_BT: Positions [B, T] (default 0..T-1).
            ssa: SSA's two streams, for training with SSA.
            probe_dropped_mass: Record each layer's dropped attention mass.
            mode: A layer mode (overrides ``ssa`` and ``probe_dropped_mass``).
            targets_BT: Targets [B, T]: return the per-token NLL instead of the logits.

        Returns:
            Logits [B, T, V], or the NLL [B, T] with ``targets_BT``.
        """
        x_BTD = self.hidden(tokens_BT, positions_BT, mode=layer_mode(ssa, probe_dropped_mass, mode))
        if targets_BT is None:
            return self.logits(x_BTD)
        return chunked_nll(self.final_norm(x_BTD), self.output_table(), targets_BT, self.cfg.logits_chunk)

    def hidden(self, tokens_BT: Array, positions_BT: Array | None = None, *, mode: LayerMode | None = None) -> Array:
        """The residual stream after the last block [B, T, D] (before the final norm).

        Args:
            tokens_BT: Token ids [B, T].
            positions_BT: Positions [B, T] (default 0..T-1).
            mode: A layer mode (default: each layer's own attention).

        Returns:
            The residual stream [B, T, D].
        """
        b, t = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x_BTD = batch_sharded(self.lookup(tokens_BT))

        def run_block(block: Block, x_BTD: Array) -> Array:
            return batch_sharded(block(x_BTD, positions_BT, mode))

        if self.cfg.scan_layers and (mode is None or isinstance(mode, SCANNABLE_MODES)):
            return scan_blocks(self.blocks, run_block, x_BTD, self.cfg.remat)
        if self.cfg.remat != "none":  # one extra forward per block instead of storing its activations
            run_block = nnx.remat(run_block, policy=REMAT[self.cfg.remat])
        for block in self.blocks:
            x_BTD = run_block(block, x_BTD)
        return x_BTD

    def lookup(self, tokens_BT: Array) -> Array:
        """Embedding rows [B, T, D] in the compute dtype (``nnx.Embed``'s numbers). Under a mesh the
        table's embed dimension is gathered first (FSDP's gather of a parameter before its use):
        a lookup into a table split along D would come out split along D, and turning that into
        the batch-split residual stream costs the partitioner a full copy.

        Args:
            tokens_BT: Token ids [B, T].

        Returns:
            The embeddings [B, T, D].
        """
        table_VD = self.embed.embedding[...].astype(self.cfg.dtype)
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            tensor = mesh.shape.get(HEAD_AXIS, 1)
            vocab_axis = HEAD_AXIS if tensor > 1 and table_VD.shape[0] % tensor == 0 else None
            table_VD = jax.lax.with_sharding_constraint(table_VD, PartitionSpec(vocab_axis, None))
        return jnp.take(table_VD, tokens_BT, axis=0)

    def output_table(self) -> Array:
        """The output projection [V, D]: the embedding table when tied, else ``lm_head``.

        Returns:
            The table [V, D].
        """
        return self.embed.embedding[...] if self.cfg.tie_embeddings else self.lm_head[...]

    def logits(self, x_BTD: Array) -> Array:
        """Final norm and the output projection, accumulated and returned in float32 even
        when the model computes in bf16 (the loss and every perplexity come from these).

        Args:
            x_BTD: The residual stream [B, T, D] (``hidden``'s output).

        Returns:
            Logits [B, T, V] float32.
        """
        return _logits(self.final_norm(x_BTD), self.output_table())

    def alphas(self) -> list[float | Array | None]:
        """Per-layer alpha (None for layers without one).

        Returns:
            One alpha per layer: a float, a traced array when learned, or None.
        """
        return [block.attn.alpha() for block in self.blocks]


def batch_sharded(x_BTD: Array) -> Array:
    """The residual stream [B, T, D] split over the mesh's batch axes and whole in T and D, at
    every block boundary, when a mesh is active and divides the batch: the layout FSDP and tensor
    parallelism both assume, stated so that the partitioner does not choose another between
    blocks (it otherwise reshards through a full copy: XLA's "involuntary full rematerialization")."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_BTD
    axes = batch_axes(mesh, x_BTD.shape[0])
    if not axes:
        return x_BTD
    return jax.lax.with_sharding_constraint(x_BTD, PartitionSpec(axes, None, None))


# What a rematerialised block keeps for its backward pass (None: only its input, jax's default).
REMAT = {"none": None, "full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
# Modes whose layers differ only in their parameters (the decoder's modes index per-layer caches).
SCANNABLE_MODES = (SSAStreams, DroppedMassProbe)


def scan_blocks(blocks: nnx.List, run_block: Callable[[Block, Array], Array], x_BTD: Array, remat: str = "none") -> Array:
    """``run_block`` over the blocks as one ``jax.lax.scan``: the per-layer parameters are stacked
    [L, ...] for the call (the model and its checkpoints keep one entry per layer), so the program
    holds one block whatever the depth. Every block runs block 0's program (ModelConfig checks
    the layers allow it). What a layer sows (SSA's loss, the probe's mass) comes out of the scan
    stacked and is sown again on its own block, so callers read it as from the unrolled loop.
    ``remat``: a key of REMAT, the block's activation checkpointing."""
    graphdef, _, rest = nnx.split(blocks[0], nnx.Param, ...)  # rest: what a caller's nnx.capture put on the blocks
    stacked_L = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(b, nnx.Param) for b in blocks))

    def body(x_BTD: Array, params) -> tuple[Array, dict]:
        block = nnx.merge(graphdef, params, rest)
        y_BTD, sown = nnx.capture(run_block, nnx.Intermediate)(block, x_BTD)
        return y_BTD, nnx.to_pure_dict(sown)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)  # under scan CSE cannot merge the recomputation
    x_BTD, sown_L = jax.lax.scan(body, x_BTD, stacked_L)
    for i, block in enumerate(blocks):
        _sow_again(block, jax.tree.map(lambda a: a[i], sown_L))
    return x_BTD


def _sow_again(module: nnx.Module, sown: dict) -> None:
    for name, value in sown.items():
        child = getattr(module, name, None)
        if isinstance(child, nnx.Module):
            _sow_again(child, value)
        else:
            for item in value:  # a sown value is the tuple of every sow() under that name
                module.sow(nnx.Intermediate, name, item)


def layer_mode(ssa: SSAStreams | None, probe_dropped_mass: bool, mode: LayerMode | None) -> LayerMode | None:
    """The one mode of a call, from the public keywords (at most one may be given)."""
    given = [m for m in (ssa, DroppedMassProbe() if probe_dropped_mass else None, mode) if m is not None]
    if len(given) > 1:
        raise ValueError("ssa, probe_dropped_mass and mode are alternatives: pass one")
    return given[0] if given else None


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
    """The number of trainable parameters (every ``nnx.Param`` element) of ``model``.

    Args:
        model: The model.

    Returns:
        The count.
    """
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
