"""The benchmark CLI runs end to end on tiny shapes (its figures are only meaningful on real ones),
and its ratios are taken round by round."""

import re

import pytest

from fibjax.bench.timing import Measurement, ratio
from launch import bench


def test_attention_bench_interleaves_rounds_and_prints_ratios(capsys):
    assert bench.main(["attention", "--seq", "64", "--paths", "static,learned_frozen", "--repeats", "2", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "rounds=3" in out
    rows = re.findall(r"\| 64 \| (\w+) \| [\d.]+ \| [\d.]+ \|", out)
    assert rows == ["static", "learned_frozen"]
    assert re.search(r"\| 64 \| learned_frozen / static \| [\d.]+ \| [\d.]+ \|", out)


def test_a_ratio_is_the_median_of_the_rounds_ratios():
    # round 2 ran under load for both paths: per-round ratios 2, 2, 1.5 (median 2); medians 30 / 20
    num = Measurement(ms=30.0, spread_ms=0, peak_mb=0, round_ms=(20.0, 200.0, 30.0))
    den = Measurement(ms=20.0, spread_ms=0, peak_mb=0, round_ms=(10.0, 100.0, 20.0))
    assert ratio(num, den) == pytest.approx(2.0)
    lone = Measurement(ms=30.0, spread_ms=0, peak_mb=0)
    assert ratio(lone, den) == pytest.approx(1.5)


def test_attention_bench_refuses_zero_rounds(capsys):
    with pytest.raises(SystemExit):
        bench.main(["attention", "--seq", "64", "--paths", "static", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_attention_bench_with_nothing_to_time_reports_the_skip(capsys):
    """cuDNN is not on a CPU: the path is skipped, and the rounds have nothing to time."""
    assert bench.main(["attention", "--seq", "64", "--paths", "cudnn", "--rounds", "2"]) == 0
    assert "cudnn: skipped" in capsys.readouterr().err
