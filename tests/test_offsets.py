"""Attended sets and alpha schedules against values worked out by hand from the paper."""

import math

import pytest

from fibjax.attention import (
    FIBONACCI_RUNGS,
    alpha_schedule,
    alpha_to_logit,
    attended_distances,
    base_rungs,
    bounded_base,
    coprime_stride,
    rung_slots,
    rung_taps,
)


def test_fibonacci_rungs():
    assert base_rungs("fibonacci", 1024) == (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987)
    assert base_rungs("fibonacci", 64) == FIBONACCI_RUNGS  # the base is length-independent


@pytest.mark.parametrize(
    "t, expected",
    [(2, (1,)), (3, (1, 2)), (1024, tuple(2**j for j in range(10))), (1025, tuple(2**j for j in range(11))), (4096, tuple(2**j for j in range(12)))],
)
def test_pow2_reach_matched(t, expected):
    assert base_rungs("pow2", t) == expected


def test_pow2_at_4x_adds_unseen_rungs():
    assert set(base_rungs("pow2", 4096)) - set(base_rungs("pow2", 1024)) == {1024, 2048}


def test_explicit_base_and_errors():
    assert base_rungs((3, 7), 100) == (3, 7)
    for bad in ("fib", (), (0, 3), (2.5,)):
        with pytest.raises(ValueError):
            base_rungs(bad, 100)


@pytest.mark.parametrize(
    "window, alpha, t, expected",
    [
        (12, 1.0, 1024, tuple(range(13)) + (13, 21, 34, 55, 89, 144, 233, 377, 610, 987)),
        (12, 1.0, 100, tuple(range(13)) + (13, 21, 34, 55, 89)),
        (8, 1.0, 1024, tuple(range(9)) + (13, 21, 34, 55, 89, 144, 233, 377, 610, 987)),
        # half-to-even: 0.5*5=2.5->2, 0.5*13=6.5->6, 0.5*21=10.5->10, 0.5*89=44.5->44, 0.5*233=116.5->116
        (6, 0.5, 1024, tuple(range(7)) + (10, 17, 28, 44, 72, 116, 188, 305, 494)),
        (6, 1.5, 1024, tuple(range(7)) + (8, 12, 20, 32, 51, 82, 134, 216, 350, 566, 915, 1480)[:-1]),
        (0, 1.0, 16, (0, 1, 2, 3, 5, 8, 13)),
        (20, 1.0, 16, tuple(range(21))),  # the window is {0..W} whatever the length
    ],
)
def test_attended_distances(window, alpha, t, expected):
    assert attended_distances(window=window, base="fibonacci", alpha=alpha, seq_len=t) == expected


def test_attended_distances_pow2_and_explicit():
    assert attended_distances(window=8, base="pow2", alpha=1.0, seq_len=1024) == tuple(range(9)) + (16, 32, 64, 128, 256, 512)
    assert attended_distances(window=2, base=(4, 4, 10), alpha=1.0, seq_len=8) == (0, 1, 2, 4)


@pytest.mark.parametrize("num_layers, stride", [(16, 7), (8, 3), (12, 5), (4, 1), (2, 1), (1, 1), (5, 2), (6, 1), (10, 3)])
def test_coprime_stride(num_layers, stride):
    assert coprime_stride(num_layers) == stride


def test_schedules():
    assert alpha_schedule("fixed", 4) == (1.0,) * 4
    assert alpha_schedule("learned", 3) == (1.0,) * 3
    stag = alpha_schedule("staggered", 16)
    assert stag[0] == 0.5 and stag[-1] == 1.5 and all(math.isclose(a, 0.5 + i / 15) for i, a in enumerate(stag))
    cop = alpha_schedule("coprime", 16)
    slots = [(7 * i) % 16 for i in range(16)]
    assert cop == tuple(0.5 + s / 15 for s in slots)
    assert sorted(cop) == sorted(stag)  # same multiset, different order
    assert cop[:3] == (0.5, 0.5 + 7 / 15, 0.5 + 14 / 15)
    assert alpha_schedule("coprime", 4) == alpha_schedule("staggered", 4)  # no coprime stride: linear
    assert alpha_schedule("staggered", 1) == alpha_schedule("coprime", 1) == (1.0,)
    with pytest.raises(ValueError):
        alpha_schedule("linear", 4)


def test_learned_rung_spec_skip_rules():
    # alpha = 1: rungs equal the static ones, frac = 0
    spec = rung_taps(window=12, base="fibonacci", alpha=1.0, seq_len=1024)
    assert [lo for _, lo, _ in spec] == [13, 21, 34, 55, 89, 144, 233, 377, 610, 987]
    assert all(frac == 0.0 for _, _, frac in spec)
    # lo > T-1 skipped
    assert [lo for _, lo, _ in rung_taps(window=12, base="fibonacci", alpha=1.0, seq_len=100)][-1] == 89
    # round(t) > W but lo == W is a window distance: skipped (the reference's "lo in used")
    assert rung_taps(window=13, base=(10,), alpha=1.36, seq_len=100) == []  # t=13.6: lo=13 used
    assert [lo for _, lo, _ in rung_taps(window=13, base=(10,), alpha=1.46, seq_len=100)] == [14]
    # first wins when two rungs share lo: t = 0.5*2=1.0 and 0.5*3=1.5 -> lo 1 twice (W=0; round(1.0)=1 > 0)
    spec = rung_taps(window=0, base=(2, 3), alpha=0.5, seq_len=100)
    assert spec == [(2, 1, 0.0)]


def test_learned_rung_bases_cover_every_alpha():
    for window in (0, 6, 12, 40):
        for t in (16, 100, 1024):
            bases = set(rung_slots(window=window, base="fibonacci", seq_len=t))
            for i in range(101):
                alpha = 0.5 + i / 100
                spec = rung_taps(window=window, base="fibonacci", alpha=alpha, seq_len=t)
                assert len(spec) <= len(bases)
                used = {math.floor(alpha * f) for f in bases}
                assert {lo for _, lo, _ in spec} <= used


def test_alpha_to_logit():
    assert alpha_to_logit(1.0) == 0.0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert math.isclose(0.5 + sig(alpha_to_logit(0.8)), 0.8)
    assert math.isclose(0.5 + sig(alpha_to_logit(0.5)), 0.55)
    assert math.isclose(0.5 + sig(alpha_to_logit(1.5)), 1.45)


def test_bounded_base_keeps_the_papers_ratio_at_a_shorter_length():
    # the paper trains at 1024 with the top rung 987 < 1024; at 256 the same rule keeps rungs <= 255
    assert bounded_base("fibonacci", 255) == (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233)
    assert bounded_base("fibonacci", 1023) == FIBONACCI_RUNGS
    assert bounded_base("fibonacci", 0) == "fibonacci" and bounded_base("pow2", 0) == "pow2"
    assert bounded_base((3, 7, 40), 10) == (3, 7)
    # a bounded list does not grow with the evaluated length; pow2 does (the control)
    at_4x = attended_distances(window=8, base=bounded_base("fibonacci", 255), alpha=1.0, seq_len=1024)
    assert at_4x == attended_distances(window=8, base=bounded_base("fibonacci", 255), alpha=1.0, seq_len=256)
    with pytest.raises(ValueError, match="pow2"):
        bounded_base("pow2", 255)
    with pytest.raises(ValueError, match="no rung"):
        bounded_base((8, 13), 5)
