"""The bench's bytes and FLOPs model (``fibjax.bench.roofline``) against counts made by hand.

The case: T = 8, B = 1, H = 2 query heads on K = 1 KV head, D = 4, float32; the offset rows with
W = 1 at the bench's alpha 1.0333 (distances 0, 1, 2, 3, 5); blocks of J = 2 keys, S = 2 (own +
one chosen); NSA's window 2 (distances 0..2).
"""

import pytest

from fibjax.bench import roofline
from fibjax.bench.attention import Case

CASE = Case(seq_len=8, heads=2, kv_heads=1, head_dim=4, window=1, sparse_block=2, sparse_blocks=2, nsa_window=2)


def test_compulsory_bytes_are_the_inputs_and_outputs_once():
    # q, out: 8 x 2 x 4 x 4 B = 256; k, v: 8 x 1 x 4 x 4 = 128; lse: 8 x 2 x 4 = 64
    assert roofline.traffic_bytes(CASE, "fwd") == 2 * 256 + 2 * 128 + 64
    # backward: reads q, k, v, out, do, lse; writes dq, dk, dv
    assert roofline.traffic_bytes(CASE, "fwd+bwd") == 832 + (256 + 128 + 128 + 256 + 256 + 64 + 256 + 128 + 128)


def test_pairs_counted_by_hand():
    assert CASE.distances == (0, 1, 2, 3, 5)
    assert roofline.pairs(CASE, "dense") == 36  # 1 + 2 + ... + 8
    assert roofline.pairs(CASE, "static") == 8 + 7 + 6 + 5 + 3  # queries with a key at each distance
    # window 0, 1; rungs at lo 2, 3, 5 (alpha 1.0333 x 2, 3, 5: each interpolated to its lower neighbour)
    assert roofline.pairs(CASE, "learned") == (8 + 7) + (6 + 5 + 3)
    # query i, block c = i // 2: own keys 1, 2, 1, 2, ...; one earlier block of 2 from c = 1 on
    assert roofline.block_pairs(8, 2, 2) == (12 + 12, 0 + 0 + 1 + 1 + 2 + 2 + 3 + 3)
    # NSA: the 24 selected, window 0..2 (8 + 7 + 6), and (i + 1) // 2 complete past blocks each
    assert roofline.pairs(CASE, "nsa") == 24 + 21 + (0 + 1 + 1 + 2 + 2 + 3 + 3 + 4)


def test_flops_counted_by_hand():
    per_pair = 4 * 4 * 2  # 4 D, 2 query heads
    assert roofline.flops(CASE, "dense", "fwd") == per_pair * 36
    assert roofline.flops(CASE, "dense", "fwd+bwd") == 3 * per_pair * 36  # the backward's four products
    choice = 2 * 4 * 12  # 2 D per (query, KV head, earlier block) score, 12 candidates
    assert roofline.flops(CASE, "block_sparse_pallas", "fwd") == per_pair * 24 + choice
    assert roofline.flops(CASE, "block_sparse", "fwd+bwd") == 3 * per_pair * 24 + choice
    blend = 2 * 3 * 4 * 14  # keys and values, 3 D a rung row (14 of them), one KV head
    assert roofline.flops(CASE, "learned_pallas", "fwd") == per_pair * 29 + blend
    compress = 2 * 2 * 4 * (2 * 4 * 4 + 4 * 4)  # k and v; 4 blocks; [J D] x [J D, D] then [D, D]
    assert roofline.flops(CASE, "nsa", "fwd") == per_pair * 61 + compress


def test_achieved_rates():
    gbs, tflops = roofline.achieved(CASE, "dense", "fwd", ms=1e-3)  # 1 us
    assert gbs == pytest.approx(832 / 1e-6 / 1e9)
    assert tflops == pytest.approx(32 * 36 / 1e-6 / 1e12)


def test_the_issue_figures_at_16k():
    """Issue 40's floor at 16k, bf16, H = K = 8, D = 64: ~70 MB forward; 256 keys a query ~8.6 GFLOP
    (the exact count is lower: the first 15 blocks have fewer earlier blocks to choose)."""
    case = Case(seq_len=16384, dtype="bfloat16")
    assert roofline.traffic_bytes(case, "fwd") / 1e6 == pytest.approx(67.6, abs=0.1)
    pairs = roofline.block_pairs(16384, 16, 16)[0]
    assert 0.95 * 16384 * 256 < pairs < 16384 * 256
    assert 4 * 64 * 8 * pairs / 1e9 == pytest.approx(8.6, rel=0.05)
