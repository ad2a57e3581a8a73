"""fibjax.eval.token_curve and the study report's section on it: runs followed against tokens seen,
their extrapolation and the gaps between them, including a run still training."""

import csv
import json
import math
from pathlib import Path

import pytest

from fibjax.config import ConfigError
from fibjax.eval.token_curve import Difference, TokenCurve, difference_points, markdown, points, run_points
from fibjax.study import Study, StudyRun, write_results
from tests.test_study import TINY, finish


def val_row(step, tokens, short, long):
    """A metrics row with the validation curve: ``short``/``long``: source -> NLL at 1x / 4x."""
    return {"step": step, "tokens": tokens, **{f"val/{s}": v for s, v in short.items()}, **{f"val_4x/{s}": v for s, v in long.items()}}


def test_a_runs_point_is_the_geometric_change_over_the_sources_logged_at_both_lengths():
    rows = [
        {"step": 5, "loss": 3.0},  # a training row: no point
        val_row(10, 40, {"x": 2.0, "y": 3.0, "z": 9.0}, {"x": 2.0 + math.log(1.21), "y": 3.0}),  # z has no 4x: left out
        val_row(20, 80, {"x": 1.0}, {}),  # 1x only: its mean, no change
    ]
    a, b = run_points("r", rows, 4)
    assert (a.step, a.tokens, a.nll_1x, a.nll_long) == (10, 40, pytest.approx(2.5), pytest.approx(2.5 + math.log(1.21) / 2))
    assert a.change_pct == pytest.approx(10.0)  # exp(mean gap) - 1 = sqrt(1.21) - 1
    assert (b.nll_1x, b.nll_long, b.change_pct) == (1.0, None, None)


def test_a_step_logged_twice_keeps_the_last_and_differences_pair_by_tokens():
    """A run resumed from a checkpoint logs the steps after it again: the later row wins. A
    difference is taken only where both runs logged the same tokens seen."""
    a = run_points("a", [val_row(10, 40, {"x": 9.0}, {"x": 9.0}), val_row(10, 40, {"x": 3.0}, {"x": 3.5}), val_row(20, 80, {"x": 2.0}, {"x": 2.5})], 4)
    assert [p.nll_1x for p in a] == [3.0, 2.0]
    b = run_points("b", [val_row(5, 40, {"x": 3.25}, {"x": 4.0}), val_row(30, 120, {"x": 1.0}, {"x": 1.0})], 4)
    (d,) = difference_points(Difference("a - b", "a", "b"), a, b)
    assert (d.series, d.tokens, d.nll_1x, d.nll_long, d.change_pct) == ("a - b", 40, pytest.approx(-0.25), pytest.approx(-0.5), None)


def test_a_token_curve_refuses_a_bad_name_multiple_or_difference():
    with pytest.raises(ConfigError, match="letters, digits"):
        TokenCurve("a b", "t", ("r",))
    with pytest.raises(ConfigError, match="multiple must be >= 2"):
        TokenCurve("c", "t", ("r",), multiple=1)
    with pytest.raises(ConfigError, match="names runs it does not follow: \\['s'\\]"):
        TokenCurve("c", "t", ("r",), differences=(Difference("r - s", "r", "s"),))


def test_the_markdown_has_a_row_per_point_and_marks_a_run_still_training():
    curve = TokenCurve("c", "t", ("a", "b"), differences=(Difference("a - b", "a", "b"),))
    metrics = {"a": [val_row(1, 1_000_000, {"x": 2.0}, {"x": 2.0 + math.log(1.5)})], "b": [val_row(1, 1_000_000, {"x": 2.5}, {"x": 2.5})]}
    run_pts, diff_pts = points(curve, metrics)
    text = markdown(curve, run_pts, diff_pts, {"a": "done", "b": "training, step 1 of 8"})
    assert "| tokens | a, 4x | b (training, step 1 of 8), 4x | a - b, 1x |" in text
    assert "| 1.00M | +50.0% | +0.0% | -0.5000 |" in text


def test_the_study_report_follows_runs_against_tokens_including_one_still_training(tmp_path):
    """A finished run and one still training (its directory's metrics, no eval file) are in the
    curve's CSV, table and figure; a run not started is left out; the difference is a - b."""
    runs = (StudyRun("a", TINY), StudyRun("b", TINY, ("seed=2",)), StudyRun("c", TINY, ("seed=3",)))
    curve = TokenCurve("both", "a and b", ("a", "b", "c"), differences=(Difference("b - a", "b", "a"),))
    study = Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=("steps=100",), token_curves=(curve,))
    run_dir = finish(study, "a", [30.0, 33.0, 36.0])
    rows = [val_row(s, s * 1000, {"fineweb": 4.0 - s / 200}, {"fineweb": 4.2 - s / 200}) for s in (50, 100)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    b_dir = Path(study.workdir) / "b"
    b_dir.mkdir(parents=True)
    b_rows = [{"step": 50, "loss": 3.0}, val_row(50, 50_000, {"fineweb": 3.70}, {"fineweb": 3.95})]
    (b_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b_rows))
    with pytest.raises(ConfigError, match="token_curves name runs it does not have"):
        Study(name="t", runs=runs, token_curves=(TokenCurve("x", "t", ("a", "nope")),))

    write_results(study)
    out = Path(study.results)
    table = list(csv.DictReader((out / "token_curve_both.csv").open()))
    assert [(r["kind"], r["series"], r["state"], r["step"]) for r in table] == [
        ("run", "a", "done", "50"),
        ("run", "a", "done", "100"),
        ("run", "b", "training, step 50 of 100", "50"),
        ("difference", "b - a", "", "50"),
    ]
    assert float(table[0]["change_4x_pct"]) == pytest.approx(100 * math.expm1(0.2), abs=1e-3)
    assert float(table[3]["nll_1x"]) == pytest.approx(3.70 - 3.75) and float(table[3]["nll_4x"]) == pytest.approx(3.95 - 3.95)
    text = (out / "report.md").read_text()
    assert "## Against tokens seen: a and b" in text and "b (training, step 50 of 100), 4x" in text
    assert (out / "token_curve_both.png").stat().st_size > 0
