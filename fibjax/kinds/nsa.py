"""NSA (paper B's gated baseline): three branches mixed by learned sigmoid gates per head: the
compressed blocks, the selected blocks (ranked by the compressed keys), and a window
(``fibjax.attention.nsa``). The layer's learned parts (gates, compression) are ``NSAParams``.

Decoding keeps one row per position and the compressed key and value of every completed block
(``kcmp``, ``vcmp``: the layer's compression of that block, computed once, in the step that
completes it), which the compressed branch attends and the selection ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fibjax import attention as attn_lib
from fibjax.kinds.base import ALWAYS, AttentionKind, own_and_cached, read, ring_cache, ring_rows, row_bytes, write_rows
from fibjax.kinds.block_sparse import BlockPlan, block_plan, block_with_own_row, num_blocks_at, selected_rows, take_rows, with_completed_block

Array = jax.Array


class BlockCompressor(nnx.Module):
    """NSA's learned compression of every block of keys (or values) into one, per KV head, the
    weights shared by the heads: mean + relu(vec(X + P) W_in) W_out (``compress_blocks``).
    P and W_out start at zero, so a fresh layer compresses by the block mean, as the reference
    code does; hidden width = head dim."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        j, e, pdt = cfg.attention.block_size, cfg.resolved_head_dim, cfg.param_dtype
        self.pos = nnx.Param(jnp.zeros((j, e), pdt), logical_axes=(None, None))
        self.w_in = nnx.Param(nnx.initializers.normal((j * e) ** -0.5)(rngs.params(), (j * e, e), pdt), logical_axes=(None, None))
        self.w_out = nnx.Param(jnp.zeros((e, e), pdt), logical_axes=(None, None))

    def __call__(self, x_BTKE: Array) -> Array:
        dt = x_BTKE.dtype
        return attn_lib.compress_blocks(x_BTKE, self.pos[...].astype(dt), self.w_in[...].astype(dt), self.w_out[...].astype(dt))


class NSAParams(nnx.Module):
    """NSA's learned parts: a sigmoid gate per (head, branch) from the layer input (a linear map,
    as the reference's g_proj; zero-initialised: every gate starts at 1/2) and the compressions."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.block_size = cfg.attention.block_size
        init = nnx.with_metadata(nnx.initializers.zeros_init(), logical_axes=("embed", "heads"))
        self.gate = nnx.Linear(cfg.d_model, cfg.num_heads * 3, use_bias=False, kernel_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.k_compress = BlockCompressor(cfg, rngs=rngs)
        self.v_compress = BlockCompressor(cfg, rngs=rngs)

    def __call__(self, x_BTD: Array, k_BTKE: Array, v_BTKE: Array) -> tuple[Array, Array, Array]:
        """(k_cmp, v_cmp [B, T // block, K, E], gates [B,T,H,3] float32)."""
        b, t, _ = x_BTD.shape
        gates_BTH3 = jax.nn.sigmoid(self.gate(x_BTD).astype(jnp.float32)).reshape(b, t, -1, 3)
        return self.k_compress(k_BTKE), self.v_compress(v_BTKE), gates_BTH3


class NSAKV(NamedTuple):
    """k, v [B, K, M, E] and kcmp, vcmp [B, K, N, E], each completed block's compressed key and value."""

    k: Array
    v: Array
    kcmp: Array
    vcmp: Array


def _nsa_params(attn, acfg) -> NSAParams:
    nsa = getattr(attn, "nsa", None)
    if nsa is None or nsa.block_size != acfg.block_size:
        raise ValueError(
            f"nsa attention with block_size {acfg.block_size} needs NSA parameters built for that block size "
            f"(this layer's: {getattr(nsa, 'block_size', None)}); set model.attention.kind=nsa, or nsa_params=true for SSA"
        )
    return nsa


class NSA(AttentionKind):
    name = "nsa"
    block_budget = True
    params_needed = True
    fixed_block_size = True  # the compression's parameters are sized by the trained block
    # a gated mix of three branches: the dropped mass is its selected branch's (``attend``'s
    # lse), but the error law's bound is about a single softmax and does not apply
    one_softmax = False

    def params(self, cfg, layer: int, rngs) -> dict:
        return {"nsa": NSAParams(cfg, rngs=rngs)}

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        k_cmp, v_cmp, gates = _nsa_params(attn, acfg)(x_BTD, k_BTKE, v_BTKE)
        return attn_lib.nsa_attention(
            q_BTHE, k_BTKE, v_BTKE, k_cmp, v_cmp, gates, block_size=acfg.block_size, num_blocks=acfg.num_blocks, window=acfg.window, return_lse=return_lse
        )

    def attended(self, acfg, alpha, seq_len):
        return None  # chosen by content (and the compressed branch reads every block)

    def plan(self, attn, max_len: int) -> BlockPlan:
        return block_plan(self, attn.cfg.attention, max_len, "nsa_prob")

    def init_cache(self, plan, batch, kv_heads, head_dim, dtype) -> NSAKV:
        k, v = super().init_cache(plan, batch, kv_heads, head_dim, dtype)
        kcmp, vcmp = (jnp.zeros((batch, kv_heads, num_blocks_at(plan), head_dim), dtype) for _ in range(2))
        return NSAKV(k, v, kcmp, vcmp)

    def prompt(self, plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD):
        k_cmp, v_cmp, gates = attn.nsa(x_BPD, k_BPKE, v_BPKE)
        out = attn_lib.nsa_attention(q_BPHE, k_BPKE, v_BPKE, k_cmp, v_cmp, gates, block_size=plan.block_size, num_blocks=plan.top + 1, window=plan.window)
        k, v = ring_cache(plan, k_BPKE, v_BPKE)
        b, kh, e = k.shape[0], k.shape[1], k.shape[3]
        kcmp, vcmp = (jnp.zeros((b, kh, num_blocks_at(plan), e), x.dtype).at[:, :, : x.shape[1]].set(jnp.swapaxes(x, 1, 2)) for x in (k_cmp, v_cmp))
        return out, NSAKV(k, v, kcmp, vcmp)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        """The three branches of ``nsa_attention`` at ``pos``, mixed by the layer's gates, with the
        compressed blocks including the block ``pos`` completes."""
        b, _, h, e = q_B1HE.shape
        block = plan.block_size
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        kcmp, vcmp = (
            with_completed_block(cached, jnp.swapaxes(compress(jnp.swapaxes(block_with_own_row(rows, own, pos, block), 1, 2)), 1, 2), pos, block)
            for cached, rows, own, compress in ((kv.kcmp, kv.k, own_k, attn.nsa.k_compress), (kv.vcmp, kv.v, own_v, attn.nsa.v_compress))
        )
        n = kcmp.shape[2]
        o_cmp, _ = read(q_BKGE, [kcmp], [vcmp], [jnp.arange(n) < (pos + 1) // block])
        rows_BKS = selected_rows(plan, q_B1HE, kcmp, pos)
        sel_valid = ((rows_BKS >= 0) & (rows_BKS < pos))[:, :, None, :]
        o_slc, _ = read(q_BKGE, [own_k, take_rows(kv.k, rows_BKS)], [own_v, take_rows(kv.v, rows_BKS)], [ALWAYS, sel_valid])
        d_W = np.arange(1, plan.window + 1)
        o_win, _ = read(q_BKGE, [own_k, ring_rows(kv.k, pos - d_W)], [own_v, ring_rows(kv.v, pos - d_W)], [ALWAYS, pos >= d_W])
        gates_BH3 = jax.nn.sigmoid(attn.nsa.gate(x_B1D).astype(jnp.float32)).reshape(b, h, 3)
        branches = (o_cmp, o_slc, o_win)
        out_BHE = sum(gates_BH3[..., i, None] * o.reshape(b, h, e).astype(q_B1HE.dtype).astype(jnp.float32) for i, o in enumerate(branches))
        out_B1HE = out_BHE.reshape(b, 1, h, e).astype(q_B1HE.dtype)
        k, v = write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE)
        return out_B1HE, NSAKV(k, v, kcmp, vcmp)

    def read_bytes(self, plan, kv) -> int:
        return kv.kcmp.nbytes + kv.vcmp.nbytes + ((plan.top + 1) * plan.block_size + plan.window) * row_bytes(kv)


NSA_KIND = NSA()
