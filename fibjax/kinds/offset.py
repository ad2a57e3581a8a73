"""Paper A's static offsets: the window {0..W} plus rungs round(alpha * f), alpha per layer from
a schedule (fixed, staggered, coprime) or given. A learned or interpolated alpha runs as the
``interpolated`` kind (``interpolated.py``), which this kind hands such configs to.

Decoding keeps a ring buffer of max(distances) + 1 rows (position p in row p mod rows): the
cache does not grow with the context, which is why offset models decode past their training
length. For Fibonacci and explicit bases the attended set restricted to the keys a position can
see does not depend on the capacity; only pow2 (reach-matched: its rungs are the powers of two
<= L - 1) changes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fibjax import attention as attn_lib
from fibjax.attention import offsets
from fibjax.kinds import registry
from fibjax.kinds.base import ALWAYS, KV, AttentionKind, LayerPlan, as_output, own_and_cached, read, ring_cache, ring_rows, row_bytes, write_rows


@dataclass(frozen=True)
class OffsetPlan(LayerPlan):
    distances: tuple[int, ...] = ()  # the attended set at the capacity, sorted, 0 first


class Offset(AttentionKind):
    name = "offset"
    bounded_context = False
    has_alpha = True

    def resolve(self, acfg):
        return registry.variant("interpolated") if self.learns_alpha(acfg) or acfg.interpolate else self

    def label(self, acfg) -> str:
        alpha = acfg.alpha if isinstance(acfg.alpha, str) else "explicit"
        learned = " (learned)" if acfg.learn_alpha and alpha != "learned" else ""
        base = acfg.base if isinstance(acfg.base, str) else "explicit"
        return f"{base} W{acfg.window} {alpha}{learned}"

    def learns_alpha(self, acfg) -> bool:
        return acfg.alpha == "learned" or acfg.learn_alpha

    def alpha(self, attn, acfg):
        return acfg.layer_alphas(attn.cfg.num_layers)[attn.layer]

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        ds = self.attended(acfg, self.alpha(attn, acfg), q_BTHE.shape[1])
        return attn_lib.offset_attention(q_BTHE, k_BTKE, v_BTKE, distances=ds, return_lse=return_lse, implementation=acfg.implementation)

    def scan_problem(self, acfg, num_layers: int) -> str | None:
        if self.learns_alpha(acfg):
            return None
        alphas = set(acfg.layer_alphas(num_layers))
        if len(alphas) == 1:
            return None
        return (
            f"needs every layer to run the same program, but alpha={acfg.alpha!r} gives the layers {len(alphas)} different "
            "static offset sets; use alpha=fixed or learn_alpha, or scan_layers=false"
        )

    def attended(self, acfg, alpha, seq_len):
        return offsets.attended_distances(window=acfg.window, base=acfg.bounded_base, alpha=alpha, seq_len=seq_len)

    def length_dependent(self, acfg) -> bool:
        return acfg.base == "pow2"  # reach-matched: its rungs are those <= the forward's length - 1

    def plan(self, attn, max_len: int) -> OffsetPlan:
        ds = tuple(d for d in self.attended(attn.cfg.attention, self.alpha(attn, attn.cfg.attention), max_len) if d < max_len)
        return OffsetPlan(self, max(ds) + 1, max_len, distances=ds)

    def prompt(self, plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD):
        impl = attn.cfg.attention.implementation
        return attn_lib.offset_attention(q_BPHE, k_BPKE, v_BPKE, distances=plan.distances, implementation=impl), ring_cache(plan, k_BPKE, v_BPKE)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        d_S = np.asarray(plan.distances[1:])  # sorted, starting at 0 (the query's own key)
        o_BKGE, _ = read(q_BKGE, [own_k, ring_rows(kv.k, pos - d_S)], [own_v, ring_rows(kv.v, pos - d_S)], [ALWAYS, pos >= d_S])
        out_B1HE = as_output(o_BKGE, q_B1HE)
        return out_B1HE, KV(*write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE))

    def read_bytes(self, plan, kv) -> int:
        return len(plan.distances) * row_bytes(kv)


OFFSET = Offset()
