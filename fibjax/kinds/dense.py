"""Dense causal attention: every query attends every earlier key (the paper's baseline)."""

from __future__ import annotations

import jax.numpy as jnp

from fibjax import attention as attn_lib
from fibjax.kinds.base import ALWAYS, KV, AttentionKind, LayerPlan, as_output, own_and_cached, read, write_rows


class Dense(AttentionKind):
    name = "dense"
    sparse = False

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        return attn_lib.dense_attention(q_BTHE, k_BTKE, v_BTKE, return_lse=return_lse, implementation=acfg.implementation)

    def plan(self, attn, max_len: int) -> LayerPlan:
        return LayerPlan(self, max_len, max_len)  # one row per position: row j holds position j

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        o_BKGE, _ = read(q_BKGE, [own_k, kv.k], [own_v, kv.v], [ALWAYS, jnp.arange(kv.k.shape[2]) < pos])
        out_B1HE = as_output(o_BKGE, q_B1HE)
        return out_B1HE, KV(*write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE))


DENSE = Dense()
