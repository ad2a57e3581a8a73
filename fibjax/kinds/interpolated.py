"""Paper A's learned alpha: the window {0..W} plus interpolated rungs at alpha * f, each read
between its near key (distance lo = floor(alpha f)) and far key (lo + 1) with weight frac, so the
loss has a gradient to alpha. A learned layer holds ``alpha_logit`` (``fibjax.attention.alpha``);
with ``interpolate=true`` and no learning, alpha is the schedule's, compiled as constants.

Decoding keeps the window plus every reachable rung's far key: a buffer of lo_max + 2 rows at the
layer's current alpha, plus one row of margin against a one-ulp difference in alpha between the
host's plan and the jitted step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fibjax import attention as attn_lib
from fibjax.attention import offsets
from fibjax.attention.alpha import PARAM, alpha_to_logit, logit_to_alpha
from fibjax.attention.offset_xla import traced_rung_taps
from fibjax.kinds.base import ALWAYS, KV, LayerPlan, as_output, own_and_cached, read, ring_cache, ring_rows, row_bytes, scores, values, write_rows
from fibjax.kinds.offset import Offset

LEARNED_MARGIN_ROWS = 1


class Alpha(nnx.Param):
    """A layer's learned alpha, held as its logit: the optimizer finds these by type
    (``model.alpha_mask``), to move them at their own learning rate."""


@dataclass(frozen=True)
class InterpolatedPlan(LayerPlan):
    distances: tuple[int, ...] = ()  # the window {0..W} within the capacity
    base_rungs: tuple[int, ...] = ()  # the base's rungs at the capacity, as an explicit base
    slots: tuple[int, ...] = ()  # the rungs some alpha can activate
    window: int = 0


class Interpolated(Offset):
    name = "interpolated"

    def resolve(self, acfg):
        return self

    def params(self, cfg, layer: int, rngs) -> dict:
        if not self.learns_alpha(cfg.attention):
            return {}
        alpha0 = cfg.attention.layer_alphas(cfg.num_layers)[layer]
        return {PARAM: Alpha(jnp.asarray(alpha_to_logit(alpha0), jnp.float32), logical_axes=())}

    def alpha(self, attn, acfg):
        if self.learns_alpha(acfg):
            return logit_to_alpha(getattr(attn, PARAM)[...])
        return super().alpha(attn, acfg)

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        alpha = self.alpha(attn, acfg)
        return attn_lib.interpolated_attention(
            q_BTHE, k_BTKE, v_BTKE, window=acfg.window, base=acfg.bounded_base, alpha=alpha, return_lse=return_lse, implementation=acfg.implementation
        )

    def reachable(self, acfg, alpha, seq_len):
        """The window and {lo, lo + 1} of every active rung at ``alpha``."""
        taps = offsets.rung_taps(window=acfg.window, base=acfg.bounded_base, alpha=alpha, seq_len=seq_len)
        far = {d for _, lo, _ in taps for d in (lo, lo + 1) if d <= seq_len - 1}
        return set(range(min(acfg.window, seq_len - 1) + 1)) | far

    def plan(self, attn, max_len: int) -> InterpolatedPlan:
        acfg = attn.cfg.attention
        window = tuple(range(min(acfg.window, max_len - 1) + 1))
        rungs = offsets.base_rungs(acfg.bounded_base, max_len)
        slots = offsets.rung_slots(window=acfg.window, base=rungs, seq_len=max_len)
        reach = window[-1]
        if slots:
            spec = jax.jit(lambda a: traced_rung_taps(a, slots, window=acfg.window, seq_len=max_len))(self.alpha(attn, acfg))
            active_lo = np.asarray(spec.lo)[np.asarray(spec.active)]
            if active_lo.size:
                reach = max(reach, int(active_lo.max()) + 1 + LEARNED_MARGIN_ROWS)
        return InterpolatedPlan(self, min(reach + 1, max_len), max_len, distances=window, base_rungs=rungs, slots=slots, window=acfg.window)

    def prompt(self, plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD):
        # an explicit base (the rungs at the capacity) keeps pow2's rungs those of the capacity
        acfg = attn.cfg.attention
        out = attn_lib.interpolated_attention(
            q_BPHE, k_BPKE, v_BPKE, window=plan.window, base=plan.base_rungs, alpha=self.alpha(attn, acfg), implementation=acfg.implementation
        )
        return out, ring_cache(plan, k_BPKE, v_BPKE)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        d_S = np.asarray(plan.distances[1:])
        keys, vals, valid = [own_k, ring_rows(kv.k, pos - d_S)], [own_v, ring_rows(kv.v, pos - d_S)], [ALWAYS, pos >= d_S]
        if not plan.slots:
            o_BKGE, _ = read(q_BKGE, keys, vals, valid)
        else:
            lo_R, frac_R, active_R = traced_rung_taps(self.alpha(attn, attn.cfg.attention), plan.slots, window=plan.window, seq_len=plan.max_len)
            near_R, far_R = pos - lo_R, jnp.maximum(pos - lo_R - 1, 0)  # the far neighbour clamped at position 0
            s_near, s_far = scores(q_BKGE, ring_rows(kv.k, near_R)), scores(q_BKGE, ring_rows(kv.k, far_R))
            rung_scores = s_near + frac_R * (s_far - s_near)  # the score is linear in the key
            o_BKGE, p_BKGR = read(q_BKGE, keys, vals, [*valid, (pos >= lo_R) & active_R], extra_scores=rung_scores)
            o_BKGE += values(p_BKGR * (1 - frac_R), ring_rows(kv.v, near_R)) + values(p_BKGR * frac_R, ring_rows(kv.v, far_R))
        out_B1HE = as_output(o_BKGE, q_B1HE)
        return out_B1HE, KV(*write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE))

    def read_bytes(self, plan, kv) -> int:
        return (len(plan.distances) + 2 * len(plan.slots)) * row_bytes(kv)


INTERPOLATED = Interpolated()
