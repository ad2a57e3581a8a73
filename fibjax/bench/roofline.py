"""What each attention path must move and compute: the bench's GB/s and TFLOP/s columns.

A path's *time* says little without its floor. Two explicit models, per path and pass:

* **bytes** (``traffic_bytes``): the compulsory HBM traffic, the same for every path of a case:
  read q, k, v and write out and lse; the backward also reads q, k, v, out, d_out, lse and writes
  dq, dk, dv. Anything a kernel moves beyond this (re-reading K/V, index metadata, partials) is its
  own overhead, which is what GB/s against the device's peak exposes.
* **FLOPs** (``flops``): the useful arithmetic, counted from the attended (query, key) pairs
  exactly (``pairs``), never from a kernel's tiles: 4 D flops per pair and query head forward (q.k
  and p.v, a multiply-add each), twice that backward (dv = p^T do, dp = do v^T, dq = ds k, dk =
  ds^T q; recomputing s is the kernel's choice, not counted), plus the work only some paths do:
  the block-sparse choice (each query's summed heads against every earlier block's key sum, 2 D a
  block and KV head; the top-k is not arithmetic), the learned path's blend of each rung's two
  neighbouring key and value rows (3 D each per rung row and KV head), NSA's compression of k and
  v (its MLP over each complete block) and its compressed and window branches.

Softmax exponentials and masks are not counted: they are what the tensor-core rate leaves behind.
The table divides each by the median time (``achieved``).
"""

from __future__ import annotations

import numpy as np

from fibjax.attention.offset_xla import frozen_rungs

# the interpolated paths: rungs at lo = floor(alpha f), each blending two neighbouring rows
LEARNED = ("learned", "learned_pallas", "learned_frozen")


def traffic_bytes(case, mode: str) -> int:
    """Compulsory HBM bytes of one call of ``mode`` ("fwd" or "fwd+bwd"); ``case`` a bench Case."""
    item = np.dtype(case.dtype).itemsize
    q_out = case.batch * case.seq_len * case.heads * case.head_dim * item
    kv = case.batch * case.seq_len * case.kv_heads * case.head_dim * item
    lse = case.batch * case.seq_len * case.heads * 4
    fwd = 2 * q_out + 2 * kv + lse
    return fwd if mode == "fwd" else fwd + (4 * q_out + 4 * kv + lse)


def _rows_from(seq_len: int, distances) -> int:
    """Queries that have a key at each distance, summed: sum_d max(T - d, 0)."""
    return int(sum(max(seq_len - d, 0) for d in distances))


def block_pairs(seq_len: int, block: int, num_blocks: int) -> tuple[int, int]:
    """(attended pairs, choice candidates) per KV-head query row of paper B's rule: query i in block
    c = i // J attends keys cJ .. i of its own block and the J keys of each of min(S-1, c) earlier
    blocks, having scored all c of them."""
    i = np.arange(seq_len)
    c = i // block
    return int(np.sum(i - c * block + 1 + block * np.minimum(num_blocks - 1, c))), int(np.sum(c))


def pairs(case, path: str) -> int:
    """Attended (query, key) pairs per query head and batch row of ``path`` (one query head)."""
    t = case.seq_len
    if path in ("dense", "cudnn", "torch_sdpa"):
        return t * (t + 1) // 2
    if path in ("static", "static_pallas"):
        return _rows_from(t, case.distances)
    if path in ("window", "cudnn_window"):
        return _rows_from(t, range(case.window_keys))
    if path in LEARNED:
        return _rows_from(t, range(case.window + 1)) + _rows_from(t, _active_rungs(case))
    if path in ("block_sparse", "block_sparse_pallas"):
        return block_pairs(t, case.sparse_block, case.sparse_blocks)[0]
    if path == "nsa":
        compressed = int(np.sum((np.arange(t) + 1) // case.sparse_block))  # the complete past blocks
        return block_pairs(t, case.sparse_block, case.sparse_blocks)[0] + _rows_from(t, range(case.nsa_window + 1)) + compressed
    raise KeyError(f"no FLOP model for path {path!r}")


def _active_rungs(case) -> list[int]:
    """The near distance lo of each rung active at the case's alpha (the learned path's own rule)."""
    return [lo for lo, _ in frozen_rungs(case.alpha, "fibonacci", window=case.window, seq_len=case.seq_len)]


def selection_flops(case) -> int:
    """The block-sparse choice: 2 D per (query, KV head, earlier block) score."""
    _, candidates = block_pairs(case.seq_len, case.sparse_block, case.sparse_blocks)
    return 2 * case.head_dim * case.batch * case.kv_heads * candidates


def _extra_flops(case, path: str) -> int:
    """Forward work beside the attention's products (module docstring); none has a backward here."""
    b, kh, d, t = case.batch, case.kv_heads, case.head_dim, case.seq_len
    if path in ("block_sparse", "block_sparse_pallas"):
        return selection_flops(case)
    if path in LEARNED:
        return 2 * 3 * d * b * kh * _rows_from(t, _active_rungs(case))
    if path == "nsa":
        j, blocks = case.sparse_block, t // case.sparse_block
        return 2 * 2 * b * kh * blocks * (j * d * d + d * d)  # k and v: [J D] x [J D, D], then [D, D]
    return 0


def flops(case, path: str, mode: str) -> int:
    """Useful FLOPs of one call of ``path`` in ``mode`` ("fwd" or "fwd+bwd")."""
    attend = 4 * case.head_dim * case.batch * case.heads * pairs(case, path)
    return (attend if mode == "fwd" else 3 * attend) + _extra_flops(case, path)


def achieved(case, path: str, mode: str, ms: float) -> tuple[float, float]:
    """(GB/s, TFLOP/s) of a call of ``ms`` milliseconds."""
    return traffic_bytes(case, mode) / (ms * 1e6), flops(case, path, mode) / (ms * 1e9)
