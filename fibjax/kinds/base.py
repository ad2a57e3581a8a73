"""The attention-kind protocol: everything the rest of fibjax asks of one way a layer attends.

A kind is one object (``registry.register``) that the model, the decoder, the evaluator, the
probe, the reports and the benchmarks ask instead of comparing kind names:

* the layer: its parameters (``params``), its alpha, its attention call (``attend``);
* decoding: the plan of a layer at a capacity (``plan``), its cache (``init_cache``), the prompt
  (``prompt``: output and cache at once) and one token against the cache (``step``), and the
  bytes a token reads (``read_bytes``, for the benchmark);
* geometry: the distances a layer attends (``attended``, None when chosen by content) and can
  reach (``reachable``), which the evaluator's "new distances at a length" and the probe use;
* words: its report label, whether it is sparse, whether it bounds a decode to the training length.

The decode helpers below (``ring_cache``, ``write_rows``, ``read``) are the pieces the built-in
kinds share: a cache keeps position p in row p % M, heads before rows ([B, K, M, E]), and a step
reads the cache as it was *before* its own position is written. Letters: B batch, T/P sequence
or prompt, H query heads, K KV heads, G = H/K, E head dim, M cache rows, S attended rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention.common import group_queries, masked_softmax, stats_dtype
from fibjax.errors import FibjaxError

if TYPE_CHECKING:
    from flax import nnx
    from jax.typing import DTypeLike

Array = jax.Array
# A kind reads the frozen ``fibjax.config.AttentionConfig`` (``acfg``) and ``ModelConfig`` (``cfg``)
# by their fields, without importing them: the config asks the registry about kinds when it
# validates, so an import here, even for types only, would tie the two modules in a circle.
AttentionConfig = ModelConfig = Any


class DecodeUnavailable(FibjaxError, NotImplementedError):
    """A kind that defines no decode plan or step cannot be decoded (a kind of your own may leave them out)."""


@dataclass(frozen=True)
class LayerPlan:
    """One layer's cache and attended set at capacity ``max_len`` (hashable: a static value of the
    decoder's jitted step). Kinds subclass it to add what their steps need."""

    kind: AttentionKind
    rows: int  # cache rows (the ring buffer's length)
    max_len: int


class KV(NamedTuple):
    """A layer's cache of keys and values, k, v [B, K, M, E]; position p is row p % M. Kinds that
    keep more (block sums, compressed blocks) have their own tuple with k and v first."""

    k: Array
    v: Array


class AttentionKind:
    """Defaults for a kind; a kind overrides what differs. ``attend``, ``plan`` and ``step`` have none."""

    name: str = ""
    sparse: bool = True  # a query attends a subset of its causal keys (--inference-mode sparse may pick it)
    bounded_context: bool = True  # decoding is bounded by the training length unless told otherwise
    block_budget: bool = False  # takes a block budget (num_blocks, block_size) at evaluation
    params_needed: bool = False  # adds parameters to a layer (an SSA dense stream must carry them: nsa_params)
    fixed_block_size: bool = False  # its parameters are sized by the trained block size (the budget may change num_blocks only)
    # its output is one softmax over a subset of the causal keys, so paper B's error law (||o -
    # o_dense|| <= 2 m max||v||) holds for it and ``launch.eval --dropped-mass`` fits it
    one_softmax: bool = True

    def resolve(self, acfg: AttentionConfig) -> AttentionKind:
        """The kind that runs ``acfg`` (self, or a variant of it).

        Args:
            acfg: The layer's ``AttentionConfig``.

        Returns:
            The kind that runs it.
        """
        return self

    def label(self, acfg: AttentionConfig) -> str:
        """How reports name this attention.

        Args:
            acfg: The layer's ``AttentionConfig``.

        Returns:
            The label.
        """
        return self.name

    # --- the layer --------------------------------------------------------------------------

    def params(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> dict[str, Any]:
        """Parameters this kind adds to a layer's attention module, as {attribute: nnx module or
        variable} (their names are the checkpoint's paths: keep them stable).

        Args:
            cfg: The ``ModelConfig``.
            layer: The layer's index.
            rngs: The ``nnx.Rngs`` to initialise them with.

        Returns:
            {attribute: module or variable}; empty by default.
        """
        return {}

    has_alpha: bool = False  # the layer has a rung scale alpha (paper A's offsets)

    def learns_alpha(self, acfg: AttentionConfig) -> bool:
        """Whether the layer's alpha is a trained parameter under ``acfg`` (never, by default).

        Args:
            acfg: The layer's ``AttentionConfig``.

        Returns:
            True when alpha is learned.
        """
        return False

    def alpha(self, attn: nnx.Module, acfg: AttentionConfig) -> float | Array | None:
        """The layer's alpha under ``acfg`` (a traced value when learned), or None.

        Args:
            attn: The layer's ``model.Attention``.
            acfg: The layer's ``AttentionConfig``.

        Returns:
            The alpha, or None for a kind without one.
        """
        return None

    def attend(
        self, attn: nnx.Module, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array, acfg: AttentionConfig, *, x_BTD: Array | None = None, return_lse: bool = False
    ) -> Array | tuple[Array, Array]:
        """The layer's attention output [B,T,H,E] (and lse [B,T,H] with ``return_lse``); ``attn``
        is the layer's ``model.Attention`` (for its parameters), ``x_BTD`` its normed input.

        Args:
            attn: The layer's ``model.Attention``.
            q_BTHE: Queries, RoPE applied.
            k_BTKE: Keys, RoPE applied.
            v_BTKE: Values.
            acfg: The layer's ``AttentionConfig``.
            x_BTD: The layer's normed input (for kinds that read it, such as NSA's gates).
            return_lse: Also return the log-sum-exp.

        Returns:
            The output, or (output, lse) with ``return_lse``.

        Raises:
            NotImplementedError: The kind defines no ``attend`` (every kind must).
        """
        raise NotImplementedError(f"attention kind {self.name!r} defines no attend()")

    def scan_problem(self, acfg: AttentionConfig, num_layers: int) -> str | None:
        """Why the layers cannot run as one scanned program (None: they can).

        Args:
            acfg: The layers' ``AttentionConfig``.
            num_layers: The number of layers.

        Returns:
            The reason, or None.
        """
        return None

    # --- geometry ---------------------------------------------------------------------------

    def attended(self, acfg: AttentionConfig, alpha: float | None, seq_len: int) -> tuple[int, ...] | None:
        """The sorted distances a layer attends at ``seq_len``, the same for every query; None when
        a query's keys are chosen by content (block-sparse selection).

        Args:
            acfg: The layer's ``AttentionConfig``.
            alpha: The layer's alpha (None for a kind without one).
            seq_len: The forward's length.

        Returns:
            The distances, or None when chosen by content.
        """
        return tuple(range(seq_len))

    def reachable(self, acfg: AttentionConfig, alpha: float | None, seq_len: int) -> set[int]:
        """Every query-key distance the layer can attend at ``seq_len`` (all of them when chosen by content).

        Args:
            acfg: The layer's ``AttentionConfig``.
            alpha: The layer's alpha (None for a kind without one).
            seq_len: The forward's length.

        Returns:
            The distances.
        """
        attended = self.attended(acfg, alpha, seq_len)
        return set(range(seq_len)) if attended is None else set(attended)

    def length_dependent(self, acfg: AttentionConfig) -> bool:
        """Whether a query's attended set depends on the length of the forward it runs in.

        Args:
            acfg: The layer's ``AttentionConfig``.

        Returns:
            True when it does (False by default).
        """
        return False

    # --- decoding ---------------------------------------------------------------------------

    def plan(self, attn: nnx.Module, max_len: int) -> LayerPlan:
        """The layer's decode plan at capacity ``max_len``: its cache rows and whatever its steps need.

        Args:
            attn: The layer's ``model.Attention``.
            max_len: The decode's capacity in positions.

        Returns:
            The plan.

        Raises:
            DecodeUnavailable: The kind defines no plan (the default).
        """
        raise DecodeUnavailable(f"decoding a {self.name!r} layer is not available: its kind defines no plan()")

    def init_cache(self, plan: LayerPlan, batch: int, kv_heads: int, head_dim: int, dtype: DTypeLike) -> tuple:
        """The empty cache (rows a position has not written are never attended).

        Args:
            plan: The layer's plan.
            batch: B.
            kv_heads: K.
            head_dim: E.
            dtype: The cache's dtype.

        Returns:
            The cache ([KV][fibjax.kinds.KV] of zeros [B, K, rows, E] by default).
        """
        return KV(*(jnp.zeros((batch, kv_heads, plan.rows, head_dim), dtype) for _ in range(2)))

    def prompt(self, plan: LayerPlan, attn: nnx.Module, q_BPHE: Array, k_BPKE: Array, v_BPKE: Array, x_BPD: Array) -> tuple[Array, tuple]:
        """The prompt's output [B,P,H,E] (as the full forward at the capacity) and the cache after it.

        Args:
            plan: The layer's plan.
            attn: The layer's ``model.Attention``.
            q_BPHE: The prompt's queries, RoPE applied.
            k_BPKE: Its keys, RoPE applied.
            v_BPKE: Its values.
            x_BPD: The layer's normed input.

        Returns:
            (output, cache).
        """
        out = self.attend(attn, q_BPHE, k_BPKE, v_BPKE, attn.cfg.attention, x_BTD=x_BPD)
        return out, ring_cache(plan, k_BPKE, v_BPKE)

    def step(self, plan: LayerPlan, attn: nnx.Module, q_B1HE: Array, k_B1KE: Array, v_B1KE: Array, x_B1D: Array, kv: tuple, pos: Array) -> tuple[Array, tuple]:
        """The output [B,1,H,E] of the query at ``pos`` (traced) and the cache with ``pos`` written.

        Args:
            plan: The layer's plan.
            attn: The layer's ``model.Attention``.
            q_B1HE: The token's query, RoPE applied.
            k_B1KE: Its key, RoPE applied.
            v_B1KE: Its value.
            x_B1D: The layer's normed input.
            kv: The cache before ``pos``.
            pos: The token's position.

        Returns:
            (output, cache).

        Raises:
            DecodeUnavailable: The kind defines no step (the default).
        """
        raise DecodeUnavailable(f"decoding a {self.name!r} layer is not available: its kind defines no step()")

    def read_bytes(self, plan: LayerPlan, kv: tuple) -> int:
        """Cache bytes one token's attention reads (the decode benchmark's memory traffic).

        Args:
            plan: The layer's plan.
            kv: The cache.

        Returns:
            The bytes.
        """
        return plan.rows * row_bytes(kv)


# --- shared decode pieces ------------------------------------------------------------------------


def row_bytes(kv: tuple) -> int:
    """One position's key and value, every KV head."""
    return kv.k.shape[1] * kv.k.shape[3] * kv.k.dtype.itemsize * 2


def ring_cache(plan: LayerPlan, k_BPKE: Array, v_BPKE: Array) -> KV:
    """The cache after a prompt of P tokens: its last min(P, M) positions in rows p % M."""
    b, p, kh, e = k_BPKE.shape
    keep = min(p, plan.rows)
    rows = np.arange(p - keep, p) % plan.rows
    k, v = (jnp.zeros((b, kh, plan.rows, e), x.dtype).at[:, :, rows].set(jnp.swapaxes(x[:, p - keep :], 1, 2)) for x in (k_BPKE, v_BPKE))
    return KV(k, v)


def write_rows(kv: tuple, k_B1KE: Array, v_B1KE: Array, pos: Array, *, after: Array) -> tuple[Array, Array]:
    """k, v with position ``pos`` (traced) stored in its row ``pos % M``, once ``after`` (the
    attention output that read the old cache) is computed.

    The write takes a zero made from ``after`` (x * 0 is not folded for floats), so it depends
    on every read of the cache. Without that order XLA:CPU copies each donated cache once or
    twice per step (the whole dense cache per token, 30 ms at 64k tokens here) instead of
    updating one row in place."""
    row = pos % kv.k.shape[2]
    zero = after.reshape(after.shape[0], 1, 1, -1)[..., :1] * 0
    return tuple(
        jax.lax.dynamic_update_slice_in_dim(c, jnp.swapaxes(x + zero.astype(x.dtype), 1, 2).astype(c.dtype), row, axis=2)
        for c, x in ((kv.k, k_B1KE), (kv.v, v_B1KE))
    )


def ring_rows(x_BKME: Array, positions_S: Array) -> Array:
    """The cached rows of absolute ``positions_S`` (ring index p mod M; callers mask p < 0)."""
    return jnp.take(x_BKME, positions_S % x_BKME.shape[2], axis=2)


def scores(q_BKGE: Array, k_BKSE: Array) -> Array:
    return jnp.einsum("bkge,bkse->bkgs", q_BKGE, k_BKSE, preferred_element_type=stats_dtype(q_BKGE))


def values(p_BKGS: Array, v_BKSE: Array) -> Array:
    return jnp.einsum("bkgs,bkse->bkge", p_BKGS, v_BKSE.astype(p_BKGS.dtype))


def read(q_BKGE: Array, keys: list[Array], vals: list[Array], valid: list, extra_scores: Array | None = None) -> tuple[Array, Array | None]:
    """One softmax over the concatenated keys ([B, K, S_i, E] each; ``valid`` [S_i] or
    [B, K, 1, S_i]) and the matching read of the values: ([B, K, G, E] float32, 0 where nothing is
    valid; the probabilities of ``extra_scores`` [B, K, G, R], columns scored by the caller and
    read by it, whose validity is the last entry of ``valid``)."""
    b, kh = q_BKGE.shape[:2]
    valid = [jnp.broadcast_to(m, (b, kh, 1, m.shape[-1])) for m in valid]
    columns = [scores(q_BKGE, k) for k in keys] + ([extra_scores] if extra_scores is not None else [])
    p_BKGS, _ = masked_softmax(jnp.concatenate(columns, -1), jnp.concatenate(valid, -1))
    o_BKGE, col = 0.0, 0
    for v in vals:
        o_BKGE += values(p_BKGS[..., col : col + v.shape[2]], v)
        col += v.shape[2]
    return o_BKGE, (p_BKGS[..., col:] if extra_scores is not None else None)


def own_and_cached(q_B1HE: Array, k_B1KE: Array, v_B1KE: Array, kv: tuple):
    """(q [B,K,G,E], own key [B,K,1,E], own value): a step's query grouped by KV head and its own
    key and value, in the cache's layout (a step reads them instead of its not yet written row)."""
    return group_queries(q_B1HE, kv.k.shape[1])[:, 0], jnp.swapaxes(k_B1KE, 1, 2), jnp.swapaxes(v_B1KE, 1, 2)


def as_output(o_BKGE: Array, q_B1HE: Array) -> Array:
    b, _, h, e = q_B1HE.shape
    return o_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


ALWAYS = np.ones(1, bool)  # the validity of a step's own key
