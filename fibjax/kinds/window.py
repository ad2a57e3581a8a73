"""Sliding window and attention sinks: the attention a practitioner runs instead of sparse offsets.

``window``: query i attends the last W keys, itself included (0 <= i - j < W, W keys: Mistral's
``sliding_window``). Unlike ``offset``'s ``window`` field, the dense window {0..W} of W + 1 keys.

``sinks`` (StreamingLLM, Xiao et al. 2023): the first S positions plus the last W keys, each key
once. As in StreamingLLM, a sink is scored at its position in the cache, not in the text: the
cache holds the S sinks and then the last W keys in order, so a query whose window has left the
sinks behind (i > S + W - 1) sees sink j at distance S + W - 1 - j. The kind rotates such a query
back by i - (S + W - 1) for the sink columns (RoPE scores depend on the difference only), so
every attended distance lies in 0 .. S + W - 1 at any length: past the training length a
sinks model meets no distance its training did not (the paper calls this position rule crucial).
The window's keys keep their true distances, which are the same in both frames.

Decoding: a ring buffer of W rows (position p in row p mod W), plus the S sink rows for
``sinks``; neither grows with the context, so both decode past the training length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention.common import group_queries
from fibjax.attention.rope import rope, rope_frequencies
from fibjax.attention.window import sinks_attention, window_attention
from fibjax.kinds.base import ALWAYS, KV, AttentionKind, LayerPlan, as_output, own_and_cached, read, ring_cache, row_bytes, scores, values, write_rows

Array = jax.Array


@dataclass(frozen=True)
class WindowPlan(LayerPlan):
    window: int = 0  # the layer's W (the ring holds min(W, capacity) rows)
    sinks: int = 0  # sink rows, min(S, capacity); 0 for ``window``


class SinkKV(NamedTuple):
    """The ring k, v [B, K, W, E] (position p in row p mod W) and the sinks' [B, K, S, E] (row j: position j)."""

    k: Array
    v: Array
    sink_k: Array
    sink_v: Array


def ring_valid(plan: WindowPlan, pos: Array) -> Array:
    """Which ring rows a step at ``pos`` reads, before its own is written: row r holds the latest
    position p < pos with p = r (mod M), at distance 1 + (pos - 1 - r) mod M; it is attended if
    that distance is inside the window and p >= 0."""
    d_M = 1 + (pos - 1 - np.arange(plan.rows)) % plan.rows
    return (d_M < plan.window) & (d_M <= pos)


def step_window(plan: WindowPlan, q_B1HE, k_B1KE, v_B1KE, kv, pos, sink_columns=None):
    """One step against the ring (and the caller's sink columns: scores and their validity)."""
    q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
    extra, valid = (None, []) if sink_columns is None else (sink_columns[0], [sink_columns[1]])
    o_BKGE, p_sinks = read(q_BKGE, [own_k, kv.k], [own_v, kv.v], [ALWAYS, ring_valid(plan, pos), *valid], extra_scores=extra)
    if sink_columns is not None:
        o_BKGE = o_BKGE + values(p_sinks, kv.sink_v)
    out_B1HE = as_output(o_BKGE, q_B1HE)
    return out_B1HE, write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE)


class Window(AttentionKind):
    name = "window"
    bounded_context = False  # a ring of W rows: decoding is not bounded by the training length

    def label(self, acfg) -> str:
        return f"window {acfg.window}"

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        return window_attention(q_BTHE, k_BTKE, v_BTKE, window=acfg.window, return_lse=return_lse, implementation=acfg.implementation)

    def attended(self, acfg, alpha, seq_len):
        return tuple(range(min(acfg.window, seq_len)))

    def plan(self, attn, max_len: int) -> WindowPlan:
        w = attn.cfg.attention.window
        return WindowPlan(self, min(w, max_len), max_len, window=w)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        out_B1HE, (k, v) = step_window(plan, q_B1HE, k_B1KE, v_B1KE, kv, pos)
        return out_B1HE, KV(k, v)


def sink_queries(attn, q_BTHE: Array, positions_BT: Array, sinks: int, window: int) -> Array:
    """The queries that score the sinks: rotated back by max(0, i - (S + W - 1)), to the query's
    position in StreamingLLM's cache (RoPE without its temperature: only the rotation moves)."""
    inv_freq_E2, _ = rope_frequencies(q_BTHE.shape[-1], attn.cfg)
    return rope(q_BTHE, -jnp.maximum(positions_BT - (sinks + window - 1), 0), inv_freq_E2)


class Sinks(Window):
    name = "sinks"
    one_softmax = False  # the sink columns are scored by moved queries: not a subset of dense attention's scores

    def label(self, acfg) -> str:
        return f"sinks {acfg.sinks} + window {acfg.window}"

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        b, t = q_BTHE.shape[:2]
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
        q_sinks = sink_queries(attn, q_BTHE, positions_BT, acfg.sinks, acfg.window)
        return sinks_attention(q_BTHE, k_BTKE, v_BTKE, sinks=acfg.sinks, window=acfg.window, q_sinks=q_sinks, return_lse=return_lse)

    def attended(self, acfg, alpha, seq_len):
        return None  # sinks are fixed positions, not distances: the set differs from query to query

    def reachable(self, acfg, alpha, seq_len):
        # the distances RoPE sees (cache positions): the window's, and the sinks' right after it
        return set(range(min(acfg.sinks + acfg.window, seq_len)))

    def plan(self, attn, max_len: int) -> WindowPlan:
        acfg = attn.cfg.attention
        return WindowPlan(self, min(acfg.window, max_len), max_len, window=acfg.window, sinks=min(acfg.sinks, max_len))

    def init_cache(self, plan, batch, kv_heads, head_dim, dtype):
        ring, sink = ((batch, kv_heads, n, head_dim) for n in (plan.rows, plan.sinks))
        return SinkKV(jnp.zeros(ring, dtype), jnp.zeros(ring, dtype), jnp.zeros(sink, dtype), jnp.zeros(sink, dtype))

    def prompt(self, plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD):
        out_BPHE = self.attend(attn, q_BPHE, k_BPKE, v_BPKE, attn.cfg.attention)
        first = min(plan.sinks, k_BPKE.shape[1])
        sink_k, sink_v = (
            jnp.zeros((x.shape[0], x.shape[2], plan.sinks, x.shape[3]), x.dtype).at[:, :, :first].set(jnp.swapaxes(x[:, :first], 1, 2))
            for x in (k_BPKE, v_BPKE)
        )
        return out_BPHE, SinkKV(*ring_cache(plan, k_BPKE, v_BPKE), sink_k, sink_v)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        acfg = attn.cfg.attention
        qs_B1HE = sink_queries(attn, q_B1HE, jnp.full(q_B1HE.shape[:2], pos), acfg.sinks, acfg.window)
        qs_BKGE = group_queries(qs_B1HE, kv.k.shape[1])[:, 0]
        sink_valid = pos - np.arange(plan.sinks) >= plan.window  # earlier than the window (j <= i follows)
        out_B1HE, (k, v) = step_window(plan, q_B1HE, k_B1KE, v_B1KE, kv, pos, (scores(qs_BKGE, kv.sink_k), sink_valid))
        return out_B1HE, SinkKV(k, v, *self._write_sink(plan, kv, k_B1KE, v_B1KE, pos))

    @staticmethod
    def _write_sink(plan, kv, k_B1KE, v_B1KE, pos):
        """Sink row ``pos`` written while pos < S (every later step leaves the sinks as they are)."""
        row = jnp.minimum(pos, plan.sinks - 1)
        out = []
        for c, x in ((kv.sink_k, k_B1KE), (kv.sink_v, v_B1KE)):
            old = jax.lax.dynamic_slice_in_dim(c, row, 1, axis=2)
            out.append(jax.lax.dynamic_update_slice_in_dim(c, jnp.where(pos < plan.sinks, jnp.swapaxes(x, 1, 2).astype(c.dtype), old), row, axis=2))
        return out

    def read_bytes(self, plan, kv) -> int:
        return (plan.rows + plan.sinks) * row_bytes(kv)


WINDOW = Window()
SINKS = Sinks()
