"""launch.report / fibjax.eval.report: tables from synthetic eval JSONs, plots, errors, and one
end-to-end report on two tiny trained runs."""

import csv
import json

import numpy as np
import pytest
from matplotlib.image import imread

from fibjax.eval import report as rep
from launch import report as launch_report
from tests.helpers import ATTN, STAGGER_BINS, TINY_RUN, fake_run, rows_for
from tests.tiers import slow

# Inputs for the fake runs, taken from the paper's length table (FineWeb, T = 1024 / 2048 / 4096)
# and posloss row (fixed minus stagger, W=8) so the tables look like the paper's.
STAGGER_PPL = [42.02, 41.65, 41.45]
DENSE_PPL = [33.37, 49.15, 100.36]
PAPER_GAP = [0.023, 0.039, 0.033, 0.040, 0.033, 0.044, 0.037, 0.037]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("runs")
    fixed_bins = [b + g for b, g in zip(STAGGER_BINS, PAPER_GAP, strict=True)]
    learned_attn = {**ATTN, "alpha": "learned"}
    return [
        fake_run(
            tmp_path,
            "dense",
            attention={**ATTN, "kind": "dense"},
            alphas=[None] * 3,
            datasets={"fineweb": rows_for(DENSE_PPL), "wiki": rows_for([30.0, 45.0, 90.0])},
        ),
        fake_run(tmp_path, "fib_stagger", datasets={"fineweb": rows_for(STAGGER_PPL), "wiki": rows_for([37.59, 37.3, 37.2])}),
        fake_run(
            tmp_path,
            "fib_fixed",
            attention={**ATTN, "alpha": "fixed"},
            alphas=[1.0] * 3,
            datasets={"fineweb": rows_for([44.08, 43.74, 43.56], fixed_bins), "wiki": rows_for([39.05, 38.8, 38.7], fixed_bins)},
        ),
        fake_run(tmp_path, "fib_learned", attention=learned_attn, alphas=[0.97, 1.02, 1.04], datasets={"fineweb": rows_for([43.7, 43.34, 43.15])}),
    ]


@pytest.fixture(scope="module")
def built(runs, tmp_path_factory):
    """The report on the four fake runs, plots included, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("report")
    return rep.build_report(runs, out, reference="fib_stagger"), out


def test_runs_that_scored_other_tokens_are_named_under_the_matrix(tmp_path):
    sets = lambda n: {"fineweb": rows_for([40.0], tokens=n), "wiki": rows_for([50.0], tokens=4096)}  # noqa: E731
    paths = [fake_run(tmp_path, name, datasets=sets(n)) for name, n in (("a", 8192), ("b", 2048), ("c", 8192))]
    runs, _ = rep.load_runs(paths)
    note = next(n for n in rep.matrix_table(runs, ["fineweb", "wiki"]).notes if "same tokens" in n)
    assert note.startswith("Tokens scored per dataset (fineweb / wiki): 8192 / 4096, except b: 2048 / 4096.")


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_tables_show_each_runs_numbers_and_compute_changes_and_gaps(runs, built):
    """The tables and CSVs against the fake runs' eval JSONs (inputs shaped like the paper's
    numbers): spot checks of the formatting, then every extrapolation row and every position gap
    recomputed here from the JSONs."""
    report, out = built
    tables = {t.name: t for t in report.tables}
    evals = {path.name: json.loads((path / "eval" / "100.json").read_text()) for path in runs}
    extrap_rows = read_csv(out / "extrap.csv")
    assert len(extrap_rows) == sum(len(rows) for e in evals.values() for rows in e["datasets"].values())
    for r in extrap_rows:
        rows = evals[r["run"]]["datasets"][r["dataset"]]
        i = [x["length"] for x in rows].index(int(r["length"]))
        assert (float(r["nll"]), float(r["ppl"]), int(r["tokens"])) == (rows[i]["nll"], rows[i]["ppl"], rows[i]["tokens"])
        assert float(r["multiplier"]) == rows[i]["length"] / 1024
        assert float(r["change_vs_first_pct"]) == pytest.approx(100 * (rows[i]["ppl"] / rows[0]["ppl"] - 1))
    ref = evals["fib_stagger"]["datasets"]
    gap_rows = {(r[0], r[1]): r[3:] for r in tables["posloss"].rows if r[2] == "minus fib_stagger"}
    assert set(gap_rows) == {(run, d) for run in ("dense", "fib_fixed", "fib_learned") for d in evals[run]["datasets"]}
    for (run, d), cells in gap_rows.items():
        row, base = evals[run]["datasets"][d][0], ref[d][0]
        assert cells == [f"{a - b:+.3f}" for a, b in zip(row["bin_nll"], base["bin_nll"])] + [f"{row['nll'] - base['nll']:+.3f}"], (run, d)

    matrix = {r[0]: r for r in tables["matrix"].rows}
    assert not any("same tokens" in n for n in tables["matrix"].notes)  # the fake runs all scored 8,192 tokens
    assert tables["matrix"].header[-2:] == ["fineweb", "wiki"]
    assert matrix["fib_stagger"][-2:] == ["42.02", "37.59"] and matrix["fib_learned"][-1] == "—"

    extrap = {r[0]: r for r in tables["extrap"].rows}
    assert extrap["fib_stagger"][3] == "42.02 / 41.65 / 41.45 (-1.4%)"  # 41.45 / 42.02 - 1 = -1.36%
    assert extrap["dense"][3] == "33.37 / 49.15 / 100.36 (+200.7%)"
    assert extrap["fib_learned"][2] == "1024 / 2048 / 4096" and extrap["fib_learned"][4] == "—"
    change = {(r["run"], r["dataset"], int(r["length"])): float(r["change_vs_first_pct"]) for r in read_csv(out / "extrap.csv")}
    assert change[("fib_stagger", "fineweb", 4096)] == pytest.approx(100 * (41.45 / 42.02 - 1))
    assert change[("fib_stagger", "fineweb", 1024)] == 0.0

    pos = {(r[0], r[1], r[2]): r for r in tables["posloss"].rows}
    assert pos[("fib_fixed", "fineweb", "minus fib_stagger")][3:11] == [f"{g:+.3f}" for g in PAPER_GAP]
    assert ("fib_stagger", "fineweb", "minus fib_stagger") not in pos
    # NLLs of a different sample of the text (another --max-tokens) are not compared
    assert rep.position_gap({"bin_nll": [1.0, 2.0], "tokens": 8192}, {"bin_nll": [1.5, 1.5], "tokens": 8192}) == [-0.5, 0.5]
    assert rep.position_gap({"bin_nll": [1.0, 2.0], "tokens": 4096}, {"bin_nll": [1.5, 1.5], "tokens": 8192}) is None
    gaps = [float(r["gap_to_fib_stagger"]) for r in read_csv(out / "posloss.csv") if r["run"] == "fib_fixed" and r["dataset"] == "fineweb"]
    np.testing.assert_allclose(gaps, PAPER_GAP, atol=1e-9)

    alpha = {(r[0], r[1]): r for r in tables["alpha"].rows}
    assert alpha[("fib_stagger", "schedule")][2:5] == ["0.500", "1.000", "1.500"]
    assert alpha[("fib_learned", "learned")][-1] == "0.040" and alpha[("fib_learned", "init")][2:5] == ["1.000"] * 3
    assert "dense" in tables["alpha"].notes[0] and not any(r[0] == "dense" for r in tables["alpha"].rows)


def test_csvs_parse_and_markdown_links_everything(built):
    report, out = built
    assert len(read_csv(out / "matrix.csv")) == 4
    assert len(read_csv(out / "extrap.csv")) == 3 * 2 * 3 + 3  # 3 runs x 2 datasets x 3 lengths + learned on one
    assert len(read_csv(out / "posloss.csv")) == 8 * 7
    learned = [r for r in read_csv(out / "alpha.csv") if r["run"] == "fib_learned"]
    assert [float(r["init"]) for r in learned] == [1.0, 1.0, 1.0] and learned[0]["learned"] == "True"
    md = (out / "report.md").read_text()
    for name in ("matrix.csv", "extrap.csv", "posloss.csv", "alpha.csv", "ppl_vs_length.png", "posloss.png", "alpha.png", "loss.png"):
        assert f"({name})" in md
    assert report.markdown == md


def test_plots_are_real_images(built):
    _, out = built
    for name in ("ppl_vs_length.png", "posloss.png", "alpha.png", "loss.png"):
        path = out / name
        assert path.stat().st_size > 10_000, name
        img = imread(path)
        assert img.shape[0] >= 500 and img.shape[1] >= 800, (name, img.shape)
        assert img[..., :3].std() > 0.05, name  # not a blank canvas


def test_smoothing_is_centred():
    from fibjax.eval.plots import smooth

    line = np.arange(50.0)
    np.testing.assert_allclose(smooth(line, 9), line)  # no lag, ends included
    steps = np.random.default_rng(1).normal(size=(200, 400))
    ends = np.array([smooth(row, 41)[-1] for row in steps])
    assert ends.std() < 0.6  # the last point averages half a window instead of jumping to the raw value (std 1)
    noisy = 5 + np.random.default_rng(0).normal(size=400)
    assert smooth(noisy, 41)[20:-20].std() < 0.3 * noisy.std()
    # min_points counts the values in a window cut by the ends: 21 at index 0, 31 at index 10
    assert np.isnan(smooth(noisy, 41, min_points=31)[[0, 9, -1]]).all() and not np.isnan(smooth(noisy, 41, min_points=31)[10:-10]).any()


def test_plots_skip_what_the_runs_lack(tmp_path):
    run = fake_run(tmp_path, "dense", attention={**ATTN, "kind": "dense"}, alphas=[None], metrics=False, datasets={"d": rows_for([5.0, 6.0])})
    report = rep.build_report([run], tmp_path / "out")
    names = {p.name for p in report.written}
    assert {"ppl_vs_length.png", "posloss.png"} <= names and not {"alpha.png", "loss.png"} & names


def test_choosing_step_dataset_and_eval_file(tmp_path):
    run = fake_run(tmp_path, "a", step=50, datasets={"x": rows_for([10.0, 11.0]), "y": rows_for([20.0, 21.0])})
    fake_run(tmp_path, "a", step=100, datasets={"x": rows_for([9.0, 9.5]), "y": rows_for([19.0, 19.5])})
    override = fake_run(tmp_path, "a", step=100, tag="kind_dense", datasets={"x": rows_for([99.0, 99.0])}) / "eval" / "100-kind_dense.json"

    latest = rep.build_report([run], tmp_path / "o1", plots=False)
    assert latest.runs[0].report["step"] == 100 and latest.tables[0].rows[0][-2:] == ["9.00", "19.00"]
    chosen = rep.build_report([run], tmp_path / "o2", step=50, dataset="y", plots=False)
    assert chosen.tables[0].header[-1] == "y" and chosen.tables[0].rows[0][-1] == "20.00"

    both = rep.build_report([run, override], tmp_path / "o3", plots=False)
    assert [r.label for r in both.runs] == ["a", "a [kind_dense]"]
    assert "[override]" in both.tables[0].rows[1][2]


def test_same_run_name_twice_is_told_apart(tmp_path):
    a = fake_run(tmp_path / "x", "r", datasets={"d": rows_for([5.0])})
    b = fake_run(tmp_path / "y", "r", datasets={"d": rows_for([6.0])})
    labels = [r.label for r in rep.build_report([a, b], tmp_path / "out", plots=False).runs]
    assert len(set(labels)) == 2


def test_gap_only_between_runs_of_the_same_training_length(tmp_path):
    a = fake_run(tmp_path, "a", datasets={"d": rows_for([5.0])})
    b = fake_run(tmp_path, "b", train_len=512, datasets={"d": rows_for([6.0], train_len=512)})
    table = rep.build_report([a, b], tmp_path / "out", reference="a", plots=False).tables[2]
    assert [r[2] for r in table.rows] == ["NLL", "NLL"]


def test_runs_without_evaluation_are_skipped_with_a_message(runs, tmp_path, capsys):
    (tmp_path / "fresh").mkdir()
    report = rep.build_report([runs[0], tmp_path / "fresh"], tmp_path / "out", plots=False)
    assert len(report.runs) == 1 and "fresh" in report.skipped[0] and "launch.eval" in report.skipped[0]
    assert "Skipped" in report.markdown
    early = fake_run(tmp_path, "early", step=50, datasets={"fineweb": rows_for([50.0])})
    at_100 = rep.build_report([runs[0], early], tmp_path / "out2", step=100, plots=False)
    assert [r.label for r in at_100.runs] == ["dense"] and "no evaluation for step 100 (has ['50.json'])" in at_100.skipped[0]
    with pytest.raises(rep.ReportError, match="no evaluated run"):
        rep.build_report([tmp_path / "fresh"], tmp_path / "out3")
    assert launch_report.main([str(tmp_path / "fresh"), "--out", str(tmp_path / "o5")]) == 2
    assert "no evaluated run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"run": "x"}), r"missing \['step'"),
        (
            json.dumps({"run": "x", "step": 1, "train_seq_len": 8, "lengths": [8], "attention": {}, "alphas": [], "datasets": {"d": [{"length": 8}]}}),
            r"datasets\['d'\]\[0\]",
        ),
    ],
)
def test_malformed_eval_json_is_an_error_naming_the_file(tmp_path, content, match):
    (tmp_path / "bad" / "eval").mkdir(parents=True)
    path = tmp_path / "bad" / "eval" / "3.json"
    path.write_text(content)
    with pytest.raises(rep.ReportError, match=match) as e:
        rep.build_report([tmp_path / "bad"], tmp_path / "out")
    assert str(path) in str(e.value)


def test_other_input_errors(runs, tmp_path):
    broken = fake_run(tmp_path, "broken", datasets={"d": rows_for([5.0])})
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')
    with pytest.raises(rep.ReportError, match=r"metrics.jsonl:2: not valid JSON"):
        rep.build_report([broken], tmp_path / "out")
    with pytest.raises(rep.ReportError, match="no such run directory"):
        rep.build_report([tmp_path / "nope"], tmp_path / "out")
    with pytest.raises(rep.ReportError, match=r"--reference nope.*fib_fixed"):
        rep.build_report([runs[0], runs[2]], tmp_path / "out", reference="nope")
    with pytest.raises(rep.ReportError, match=r"--dataset c4.*fineweb"):
        rep.build_report([runs[0]], tmp_path / "out", dataset="c4")


def test_cli_prints_tables_and_paths(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert launch_report.main([*map(str, runs), "--out", str(out), "--reference", "fib_stagger", "--dataset", "fineweb", "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "42.02 / 41.65 / 41.45 (-1.4%)" in text and "minus fib_stagger" in text and "| wiki" not in text
    assert str(out / "report.md") in text and str(out / "extrap.csv") in text and ".png" not in text


@slow
def test_report_on_two_tiny_trained_runs(tmp_path):
    from pathlib import Path

    from fibjax.config import apply_overrides, load_config_file
    from fibjax.eval.runner import evaluate_workdir
    from fibjax.train.loop import train

    tiny = load_config_file(Path(__file__).resolve().parent.parent / "configs" / "tiny.py")
    common = ["steps=4", *TINY_RUN, "eval.max_tokens=2048", "eval.length_multipliers=(1,4)"]
    dirs = []
    shared_data = [f"data.path={tmp_path / 'dense' / 'data'}"]  # the second run reuses the first run's prepared corpus
    for name, attention in (("dense", ["model.attention.kind=dense"]), ("fib_learned", ["model.attention.alpha=learned", *shared_data])):
        cfg = apply_overrides(tiny, [*common, f"name={name}", *attention])
        train(cfg, tmp_path / name, progress=False)
        evaluate_workdir(tmp_path / name)
        dirs.append(tmp_path / name)

    out = tmp_path / "report"
    report = rep.build_report(dirs, out, reference="dense")
    extrap = {r["run"]: r for r in read_csv(out / "extrap.csv") if r["multiplier"] == "4.0"}
    assert set(extrap) == {"dense", "fib_learned"} and int(extrap["dense"]["length"]) == 128
    assert any(r[2] == "minus dense" for r in report.tables[2].rows)
    alpha = {(r[0], r[1]) for r in report.tables[3].rows}
    assert alpha == {("fib_learned", "learned"), ("fib_learned", "init")}
    for name in ("ppl_vs_length.png", "posloss.png", "alpha.png", "loss.png"):
        assert imread(out / name).shape[1] >= 800


def test_the_extrapolation_caption_says_which_token_count_belongs_to_which_rows(tmp_path):
    """It used to print "(8192 / 4096 tokens scored per dataset)" with no word of which is which."""
    full = fake_run(tmp_path, "full", datasets={"fineweb": rows_for([30.0, 31.0]), "edu": rows_for([40.0, 41.0], tokens=4096)})
    capped = fake_run(tmp_path, "capped", datasets={"fineweb": rows_for([30.0, 31.0], tokens=2048), "edu": rows_for([40.0, 41.0], tokens=4096)})
    third = fake_run(tmp_path, "third", datasets={"fineweb": rows_for([30.0, 31.0]), "edu": rows_for([40.0, 41.0], tokens=4096)})
    report = rep.build_report([full, capped, third], tmp_path / "out", plots=False)
    (note,) = next(t for t in report.tables if t.name == "extrap").notes
    assert note.endswith("Tokens scored: fineweb 8192 (2048 for capped), edu 4096.")


def test_a_learned_runs_initial_alphas_are_the_evaluators(tmp_path):
    """Without a recorded alpha_init the report used the bare schedule (0.5 .. 1.5), the evaluator
    the values a learned layer really starts from (pulled into 0.55 .. 1.45): now one rule."""
    from fibjax.attention.alpha import initial_alphas
    from fibjax.config import AttentionConfig

    attention = {**ATTN, "alpha": "staggered", "learn_alpha": True}
    run = fake_run(tmp_path, "learned", datasets={"fineweb": rows_for([30.0])}, attention=attention, alphas=(0.6, 1.0, 1.4))
    (loaded,), _ = rep.load_runs([run])
    assert loaded.initial_alphas() == pytest.approx([0.55, 1.0, 1.45])
    assert loaded.initial_alphas() == initial_alphas(AttentionConfig(**attention), 3)
