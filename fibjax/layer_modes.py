"""Attention layers that compute more than their own attention: SSA's two streams (training) and
the dropped-mass probe (evaluation).

A mode is called by ``model.Attention`` in place of its plain attention, with the layer and its
RoPE'd q [B,T,H,E], k, v [B,T,K,E] and normed input x [B,T,D]; it returns the output the layer
passes on and records its extras with ``attn.sow(nnx.Intermediate, ...)``, which callers read
with ``nnx.capture``. The attention module itself stays plain attention.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fibjax import attention as attn_lib
from fibjax import kinds
from fibjax.config import AttentionConfig

Array = jax.Array
DENSE = AttentionConfig(kind=kinds.FULL)  # SSA's full stream


def smooth_l1(a: Array, b: Array) -> Array:
    """Mean SmoothL1 with beta = 1 (torch's default, as the SSA reference) = optax's Huber loss
    with delta = 1, in float32."""
    return jnp.mean(optax.losses.huber_loss(a.astype(jnp.float32), b.astype(jnp.float32), delta=1.0))


def ssa_alignment(full_BTHE: Array, sparse_BTHE: Array) -> Array:
    """SmoothL1(full, sg(sparse)) (full learns to be sparse) + SmoothL1(sg(full), sparse)
    (sparse stays near full), on per-head attention outputs before the output projection."""
    sg = jax.lax.stop_gradient
    return smooth_l1(full_BTHE, sg(sparse_BTHE)) + smooth_l1(sg(full_BTHE), sparse_BTHE)


class SSAStreams(NamedTuple):
    """Paper B training: run both streams, pass on the sparse one iff ``use_sparse`` (traced);
    every layer records the alignment loss of the two as ``ssa_align``."""

    sparse: AttentionConfig
    use_sparse: Array

    def __call__(self, attn, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array, x_BTD: Array) -> Array:
        full_BTHE = attn.attend(q_BTHE, k_BTKE, v_BTKE, DENSE)
        sparse_BTHE = attn.attend(q_BTHE, k_BTKE, v_BTKE, self.sparse, x_BTD=x_BTD)
        attn.sow(nnx.Intermediate, "ssa_align", ssa_alignment(full_BTHE, sparse_BTHE))
        return jnp.where(self.use_sparse, sparse_BTHE, full_BTHE)  # only the chosen stream is passed on


class DroppedMassProbe(NamedTuple):
    """Evaluation: the layer's own attention, and what it drops against dense attention.

    Records ``dropped_mass`` [B] (per sequence, the mean over queries and heads of 1 - exp(lse - lse_dense)). With
    ``per_query``, also per query and head [B,T,H] float32: ``mass``; ``error``, the L2 norm of
    (own output - dense output) over the head dim; and ``bound`` = 2 * mass * max_{j<=i} ||v_j||.
    Paper B's law: with m the dropped mass, o_dense = (1-m) o_own + m o_dropped, so
    ||o_own - o_dense|| = m ||o_own - o_dropped|| <= 2 m max ||v||: linear in m (exact when the
    own keys are a subset of the causal keys: every sparse path here)."""

    per_query: bool = False

    def __call__(self, attn, q_BTHE: Array, k_BTKE: Array, v_BTKE: Array, x_BTD: Array) -> Array:
        out_BTHE, lse_BTH = attn.attend(q_BTHE, k_BTKE, v_BTKE, x_BTD=x_BTD, return_lse=True)
        dense_BTHE, dense_lse_BTH = attn_lib.dense_attention(q_BTHE, k_BTKE, v_BTKE, return_lse=True)
        attn.sow(nnx.Intermediate, "dropped_mass", attn_lib.dropped_mass(lse_BTH, dense_lse_BTH, axis=(1, 2)))
        if self.per_query:
            mass_BTH = attn_lib.dropped_mass(lse_BTH, dense_lse_BTH, axis=())
            error_BTH = jnp.linalg.norm(out_BTHE.astype(jnp.float32) - dense_BTHE.astype(jnp.float32), axis=-1)
            vmax_BTK = jax.lax.cummax(jnp.linalg.norm(v_BTKE.astype(jnp.float32), axis=-1), axis=1)  # max over keys j <= i
            vmax_BTH = jnp.repeat(vmax_BTK, q_BTHE.shape[2] // k_BTKE.shape[2], axis=2)  # query head h uses KV head h // G
            attn.sow(nnx.Intermediate, "mass", mass_BTH)
            attn.sow(nnx.Intermediate, "error", error_BTH)
            attn.sow(nnx.Intermediate, "bound", 2.0 * mass_BTH * vmax_BTH)
        return out_BTHE
