"""Block-sparse attention (MoBA; SSA's sparse stream, paper B): a query attends its own block and
the ``num_blocks - 1`` earlier blocks that score highest (``fibjax.attention.block_sparse``).

Decoding keeps one row per position and the key sum of every completed block (``ksum``, written
once, by the step of the block's last position), so a step scores N = L / block_size block sums
and reads only the selected blocks' rows. The rows are rounded up to whole blocks (a step reads
the whole block of its position). Letters: N blocks, J keys per block, S selected rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fibjax import attention as attn_lib
from fibjax.attention.block_sparse import num_earlier_blocks
from fibjax.attention.common import masked_softmax
from fibjax.kinds.base import AttentionKind, LayerPlan, as_output, own_and_cached, read, ring_cache, row_bytes, write_rows

Array = jax.Array


@dataclass(frozen=True)
class BlockPlan(LayerPlan):
    block_size: int = 0
    top: int = 0  # earlier blocks selected besides the own one (as the full forward at max_len)
    rank: str = "mean_key"  # block_rank; NSA: nsa_prob over its compressed keys
    window: int = 0  # NSA's window branch


class BlockKV(NamedTuple):
    """k, v [B, K, M, E] and ksum [B, K, N, E] float32, the key sum of each completed block."""

    k: Array
    v: Array
    ksum: Array


def num_blocks_at(plan: BlockPlan) -> int:
    return -(-plan.max_len // plan.block_size)


def block_plan(kind: AttentionKind, acfg, max_len: int, rank: str) -> BlockPlan:
    top = num_earlier_blocks(max_len, acfg.block_size, acfg.num_blocks)
    whole_blocks = -(-max_len // acfg.block_size) * acfg.block_size
    return BlockPlan(kind, whole_blocks, max_len, block_size=acfg.block_size, top=top, rank=rank, window=acfg.window)


def with_completed_block(per_block_BKNE: Array, new_BK1E: Array, pos: Array, block: int) -> Array:
    """``per_block`` with entry pos // block replaced by ``new`` iff ``pos`` completes its block
    (a block's sum or compressed key is written once, by the step of its last position)."""
    old_BK1E = jax.lax.dynamic_slice_in_dim(per_block_BKNE, pos // block, 1, axis=2)
    done = (pos + 1) % block == 0
    return jax.lax.dynamic_update_slice_in_dim(per_block_BKNE, jnp.where(done, new_BK1E.astype(old_BK1E.dtype), old_BK1E), pos // block, axis=2)


def block_with_own_row(x_BKME: Array, own_BK1E: Array, pos: Array, block: int) -> Array:
    """The rows [B, K, J, E] of the block holding ``pos``, its row ``pos`` taken from ``own`` (the
    cache holds rows before ``pos`` only)."""
    start = pos // block * block
    rows_BKJE = jax.lax.dynamic_slice_in_dim(x_BKME, start, block, axis=2)
    return jnp.where(((start + jnp.arange(block)) == pos)[None, None, :, None], own_BK1E.astype(x_BKME.dtype), rows_BKJE)


def selected_rows(plan: BlockPlan, q_B1HE: Array, rank_BKNE: Array, pos: Array) -> Array:
    """Rows [B, K, S * J] of the blocks the query at ``pos`` attends (-1: an empty slot), chosen
    as ``block_sparse_attention`` chooses: its own block, then the ``plan.top`` earlier blocks
    that score highest, ties to the lower block. ``mean_key``: (sum over the group's heads of q)
    . (key sum); ``nsa_prob``: the sum over the group's heads of each head's softmax probability
    of the block among those wholly in the past, logits q . rank key / sqrt(E) (``rank_BKNE``:
    the block means, or NSA's compressed keys, with the block ``pos`` completes included)."""
    b, _, h, e = q_B1HE.shape
    kh, n = rank_BKNE.shape[1], rank_BKNE.shape[2]
    own = pos // plan.block_size
    blocks_BKS = jnp.full((b, kh, 1), own, jnp.int32)
    if plan.top:
        hi = jax.lax.Precision.HIGHEST
        q_BKGE = q_B1HE[:, 0].astype(jnp.float32).reshape(b, kh, h // kh, e)
        if plan.rank == "mean_key":
            s_BKN = jnp.einsum("bke,bkne->bkn", jnp.sum(q_BKGE, axis=2), rank_BKNE, precision=hi)
        else:
            s_BKGN = jnp.einsum("bkge,bkne->bkgn", q_BKGE, rank_BKNE.astype(jnp.float32), precision=hi) / math.sqrt(e)
            p_BKGN, _ = masked_softmax(s_BKGN, jnp.arange(n) < (pos + 1) // plan.block_size)
            s_BKN = jnp.sum(p_BKGN, axis=2)
        _, idx_BKT = jax.lax.top_k(jnp.where(jnp.arange(n) < own, s_BKN, -jnp.inf), plan.top)
        blocks_BKS = jnp.concatenate([blocks_BKS, jnp.where(idx_BKT < own, idx_BKT, -1).astype(jnp.int32)], axis=-1)
    rows_BKSJ = blocks_BKS[..., None] * plan.block_size + jnp.arange(plan.block_size)
    return jnp.where(blocks_BKS[..., None] >= 0, rows_BKSJ, -1).reshape(b, kh, -1)


def take_rows(x_BKME: Array, rows_BKS: Array) -> Array:
    """x's rows per (batch, KV head): [B, K, S, E] (rows outside the cache read row 0; callers mask them)."""
    idx = jnp.clip(rows_BKS, 0, x_BKME.shape[2] - 1)
    return jnp.take_along_axis(x_BKME, idx[..., None], axis=2)


class BlockSparse(AttentionKind):
    name = "block_sparse"
    block_budget = True

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        return attn_lib.block_sparse_attention(
            q_BTHE,
            k_BTKE,
            v_BTKE,
            block_size=acfg.block_size,
            num_blocks=acfg.num_blocks,
            block_rank=acfg.block_rank,
            return_lse=return_lse,
            implementation=acfg.implementation,
        )

    def attended(self, acfg, alpha, seq_len):
        return None  # chosen by content

    def plan(self, attn, max_len: int) -> BlockPlan:
        return block_plan(self, attn.cfg.attention, max_len, attn.cfg.attention.block_rank)

    def init_cache(self, plan, batch, kv_heads, head_dim, dtype) -> BlockKV:
        k, v = super().init_cache(plan, batch, kv_heads, head_dim, dtype)
        return BlockKV(k, v, jnp.zeros((batch, kv_heads, num_blocks_at(plan), head_dim), jnp.float32))

    def prompt(self, plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD):
        # a query's choice depends only on earlier blocks: the prompt alone decides it
        out = attn_lib.block_sparse_attention(q_BPHE, k_BPKE, v_BPKE, block_size=plan.block_size, num_blocks=plan.top + 1, block_rank=plan.rank)
        k, v = ring_cache(plan, k_BPKE, v_BPKE)
        b, p, kh, e = k_BPKE.shape
        done = p // plan.block_size
        sums_BNKE = jnp.sum(jnp.swapaxes(k[:, :, : done * plan.block_size], 1, 2).reshape(b, done, plan.block_size, kh, e).astype(jnp.float32), axis=2)
        ksum = jnp.zeros((b, kh, num_blocks_at(plan), e), jnp.float32).at[:, :, :done].set(jnp.swapaxes(sums_BNKE, 1, 2))
        return out, BlockKV(k, v, ksum)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        rank_BKNE = kv.ksum
        if plan.rank == "nsa_prob":  # block means, the own block's complete with this key
            own_sum_BK1E = jnp.sum(block_with_own_row(kv.k, own_k, pos, plan.block_size).astype(jnp.float32), axis=2, keepdims=True)
            rank_BKNE = with_completed_block(kv.ksum, own_sum_BK1E, pos, plan.block_size) / plan.block_size
        rows_BKS = selected_rows(plan, q_B1HE, rank_BKNE, pos)
        valid = ((rows_BKS >= 0) & (rows_BKS < pos))[:, :, None, :]
        o_BKGE, _ = read(q_BKGE, [own_k, take_rows(kv.k, rows_BKS)], [own_v, take_rows(kv.v, rows_BKS)], [jnp.ones(1, bool), valid])
        out_B1HE = as_output(o_BKGE, q_B1HE)
        k, v = write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE)
        # the block's rows (this one just written), summed as the full forward sums a block
        start = pos // plan.block_size * plan.block_size
        sum_BK1E = jnp.sum(jax.lax.dynamic_slice_in_dim(k, start, plan.block_size, axis=2).astype(jnp.float32), axis=2, keepdims=True)
        return out_B1HE, BlockKV(k, v, with_completed_block(kv.ksum, sum_BK1E, pos, plan.block_size))

    def read_bytes(self, plan, kv) -> int:
        return kv.ksum.nbytes + (plan.top + 1) * plan.block_size * row_bytes(kv)


BLOCK_SPARSE = BlockSparse()
