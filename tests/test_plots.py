"""The plots read honestly: a perplexity axis that does not blow up a 0.5% change, the validation
curve drawn with the training loss, and no title cut at the figure's edges."""

import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from fibjax.config import ConfigError
from fibjax.eval import passkey, plots
from fibjax.eval import report as rep
from tests.helpers import fake_run, inside_the_figure, rows_for


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the plots save, kept for the test to read (the PNG is still written)."""
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    return figures


def test_a_half_percent_change_in_perplexity_stays_small_on_the_axis(tmp_path, drawn):
    runs, _ = rep.load_runs([fake_run(tmp_path, "tiny", datasets={"python_docs": rows_for([291.2, 291.9, 292.4])})])
    assert plots.plot_ppl_vs_length(runs, ["python_docs"], tmp_path / "ppl.png", plots.run_styles(["tiny"]))
    low, high = drawn[0].axes[0].get_ylim()
    assert high - low >= plots.MIN_PPL_SPAN * 291.8 and low < 291.2 and high > 292.4
    assert 0.1 * (high - low) > 292.4 - 291.2  # the change covers under a tenth of the axis
    wide, _ = rep.load_runs([fake_run(tmp_path / "w", "a", datasets={"d": rows_for([20.0, 40.0, 50.0])})])
    plots.plot_ppl_vs_length(wide, ["d"], tmp_path / "wide.png", plots.run_styles(["a"]))
    low, high = drawn[1].axes[0].get_ylim()
    assert 18.0 < low < 20.0 and 50.0 < high < 52.0  # a wide spread keeps the axis tight around it


def test_loss_png_draws_the_validation_curve_beside_the_training_loss(tmp_path, drawn):
    workdir = fake_run(tmp_path, "tiny", datasets={"d": rows_for([50.0])}, step=100)
    val = {25: (5.0, 4.0), 50: (4.0, 3.0), 100: (4.5, 3.5)}  # two validation sources
    with (workdir / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps({"step": s, "val/a": a, "val/b": b}) + "\n" for s, (a, b) in val.items())
    runs, _ = rep.load_runs([workdir])
    assert plots.plot_loss(runs, tmp_path / "loss.png", plots.run_styles(["tiny"]))
    fig = drawn[0]
    assert fig.get_suptitle() == "Training and validation loss" and "validation NLL" in fig.axes[0].get_title()
    dashed = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert len(dashed) == 1
    np.testing.assert_allclose(dashed[0].get_xdata(), [25, 50, 100])
    np.testing.assert_allclose(dashed[0].get_ydata(), [4.5, 3.5, 4.0])  # the mean over the sources
    without, _ = rep.load_runs([fake_run(tmp_path / "x", "plain", datasets={"d": rows_for([50.0])})])
    plots.plot_loss(without, tmp_path / "plain.png", plots.run_styles(["plain"]))
    assert drawn[1].get_suptitle() == "Training loss"
    log_scaled = [fig for fig in drawn if fig.axes[0].get_yscale() == "log"]
    assert all("log scale" in fig.axes[0].get_ylabel() for fig in log_scaled)
    assert all("log scale" not in fig.axes[0].get_ylabel() for fig in drawn if fig not in log_scaled)


def test_a_log_scaled_loss_axis_says_so(tmp_path, drawn):
    workdir = fake_run(tmp_path, "tiny", datasets={"d": rows_for([50.0])}, step=100)
    with (workdir / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps({"step": s, "loss": 8.0 / s**0.5}) + "\n" for s in range(1, 101))
    runs, _ = rep.load_runs([workdir])
    plots.plot_loss(runs, tmp_path / "loss.png", plots.run_styles(["tiny"]))
    assert drawn[0].axes[0].get_yscale() == "log" and drawn[0].axes[0].get_ylabel() == "loss (nats per token, log scale)"


def test_the_alpha_plot_explains_open_markers_only_when_it_draws_them(tmp_path, drawn):
    runs, _ = rep.load_runs([fake_run(tmp_path, "ramp", datasets={"d": rows_for([50.0])}, alphas=(0.5, 1.0, 1.5))])
    plots.plot_alpha(runs, tmp_path / "alpha.png", plots.run_styles(["ramp"]))
    assert "open markers" not in drawn[0].axes[0].get_title() and "shaded" in drawn[0].axes[0].get_title()


def test_titles_wrap_between_phrases():
    title = "Passkey retrieval: tiny step 200, trained at 256 (offset attention)"
    assert plots.wrap_phrases(title, 30) == "Passkey retrieval:\ntiny step 200, trained at 256\n(offset attention)"
    assert plots.wrap_phrases("short", 30) == "short"


def test_a_long_passkey_title_is_wrapped_not_cut(tmp_path, monkeypatch):
    saved = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig) or savefig(fig, *a, **k))
    title = "Passkey retrieval: fib_stagger_w8_seed44 step 2000, trained at 256 (offset attention, kind=offset window=8)"
    result = {
        "title": title,
        "lengths": [256, 512],
        "depths": [0.0, 0.5, 1.0],
        "accuracy": [[0.0, 0.2], [0.4, 0.6], [0.8, 1.0]],
        "correct": [[0, 1], [2, 3], [4, 5]],
        "trials": 5,
        "mean_accuracy": 0.5,
    }
    passkey.plot_heatmap(result, tmp_path / "passkey.png")
    assert inside_the_figure(saved[0]) == []
    assert saved[0].axes[0].get_title().replace("\n", " ").startswith(title)  # wrapped, every word kept


def test_fit_titles_wraps_a_suptitle_wider_than_a_one_panel_figure():
    fig, _ = plots._panels(1, width=4.0)
    fig.suptitle("a long figure title that explains what the shaded band, the dotted line and the thin lines mean")
    plots.fit_titles(fig)
    assert inside_the_figure(fig) == [] and "\n" in fig.get_suptitle()


def test_the_alpha_plot_draws_equal_fixed_schedules_once_and_evaluation_variants_not_at_all(tmp_path, drawn):
    """A study has many seeds of one fixed schedule: one line each made the legend push the panel
    off the figure. Equal alphas are one line, "RUN (+k alike)"; a run's extra evaluation none."""
    d = {"d": rows_for([50.0])}
    paths = [fake_run(tmp_path, n, datasets=d, alphas=(1.0, 1.0, 1.0)) for n in ("a", "b", "c")]
    paths += [fake_run(tmp_path, "ramp", datasets=d, alphas=(0.5, 1.0, 1.5)), fake_run(tmp_path, "a", datasets=d, alphas=(1.0, 1.0, 1.0), tag="sparse")]
    runs, _ = rep.load_runs(paths)
    assert len(runs) == 5
    assert plots.plot_alpha(runs, tmp_path / "alpha.png", plots.run_styles([r.label for r in runs]))
    labels = [line.get_label() for line in drawn[0].axes[0].lines if not line.get_label().startswith("_")]
    assert len(labels) == 2 and labels[0].startswith("a") and labels[0].endswith(" (+2 alike)") and labels[1] == "ramp"
    assert not inside_the_figure(drawn[0])


def test_the_long_curve_legend_fits_its_one_panel_figure_and_its_runs_differ_in_colour(tmp_path, drawn):
    # the study's case: five curves among dozens of runs, long names, one 6.5-inch panel; before,
    # a four-column legend ran off both edges and runs 8 apart in the study shared one colour
    from types import SimpleNamespace

    metrics = [{"step": s, "tokens": 1000 * s, "val/a": 5.0, "val_4x/a": 5.0 + 0.01 * s} for s in (1, 2)]
    names = ["dense_seed44", "fib_fixed_w12", "fib_stagger_w12", "dense_512", "dense_retrofit_stagger_w8"]
    runs = [SimpleNamespace(label=n, workdir=tmp_path / n, metrics=metrics) for n in names]
    assert plots.plot_long_curves(runs, tmp_path / "long.png")
    fig = drawn[0]
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert -1 <= box.x0 and box.x1 <= fig.bbox.width + 1, (box, fig.bbox)
    assert [t.get_text() for t in legend.get_texts()] == names
    colours = [line.get_color() for line in fig.axes[0].lines[1:]]  # after the zero line
    assert len(set(colours)) == len(names)


def test_evaluations_of_one_checkpoint_at_other_lengths_are_one_line(tmp_path, drawn):
    # a study's extra "--lengths 256,2048,4096" evaluation continues its run's line; an evaluation
    # with other settings (here RoPE scaling) keeps a line of its own
    base = fake_run(tmp_path, "dense", datasets={"d": rows_for([10.0, 11.0, 12.0], train_len=256)}, train_len=256)
    report = json.loads((base / "eval" / "100.json").read_text())
    rows = [{**r, "length": n} for r, n in zip(rows_for([10.0, 15.0, 20.0], train_len=256), (256, 2048, 4096))]
    longer = {**report, "lengths": [256, 2048, 4096], "datasets": {"d": rows}}
    (base / "eval" / "100-lengths.json").write_text(json.dumps(longer))
    (base / "eval" / "100-yarn.json").write_text(json.dumps({**report, "rope": {"scaling": "yarn"}}))
    runs, _ = rep.load_runs([base / "eval" / f for f in ("100.json", "100-lengths.json", "100-yarn.json")])
    assert len(runs) == 3
    assert plots.plot_ppl_vs_length(runs, ["d"], tmp_path / "ppl.png", plots.run_styles([r.label for r in runs]))
    lines = {line.get_label(): line for line in drawn[0].axes[0].lines if not line.get_label().startswith("_")}
    assert sorted(lines) == sorted([runs[0].label, runs[2].label])
    np.testing.assert_array_equal(lines[runs[0].label].get_xdata(), [256, 512, 1024, 2048, 4096])
    np.testing.assert_allclose(lines[runs[0].label].get_ydata(), [10.0, 11.0, 12.0, 15.0, 20.0])


def test_fit_titles_wraps_a_panel_title_wider_than_its_panel():
    # the error-law figure's three panel titles ran into one another: each fits the figure, not its panel
    fig, axes = plots._panels(3, width=4.0)
    for ax in axes.flat:
        ax.set_title("ssa_fullattn [study-inference-mode_sparse_dropped-mass_max-tokens_32768]: slope 1.25, min R2 0.59")
    plots.fit_titles(fig)
    fig.draw_without_rendering()
    boxes = [ax.title.get_window_extent() for ax in axes.flat]
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), boxes
    assert all("\n" in ax.get_title() for ax in axes.flat)


def test_figure_groups_draw_each_group_apart_without_the_error_law_repeats(tmp_path, drawn):
    """A report of many runs draws perplexity vs length and NLL by position once per group: the
    group's runs in its order, a run's error-law evaluation (fewer tokens, repeating another) left
    out unless it is the run's only one, the position gaps against the group's own reference."""
    from fibjax.eval.groups import FigureGroup, group_runs

    d = {"d": rows_for([30.0, 33.0, 36.0])}
    dirs = [fake_run(tmp_path, n, datasets=d) for n in ("dense", "fib", "ssa")]  # moba: the error law only
    fake_run(tmp_path, "ssa", datasets=d, tag="sparse")
    for name in ("ssa", "moba"):  # the error law's evaluation of each
        path = fake_run(tmp_path / "law", name, datasets=d, tag="law") / "eval" / "100-law.json"
        report = json.loads(path.read_text())
        path.write_text(json.dumps({**report, "dropped_mass": {}}))
        dirs.append(path)
    longer = json.loads((tmp_path / "fib" / "eval" / "100.json").read_text())  # the same checkpoint at more lengths
    longer.update(lengths=[1024, 2048], datasets={"d": rows_for([30.0, 40.0])})
    (tmp_path / "fib" / "eval" / "100-long.json").write_text(json.dumps(longer))
    extra = [tmp_path / "ssa" / "eval" / "100-sparse.json", tmp_path / "fib" / "eval" / "100-long.json"]
    runs, _ = rep.load_runs([*dirs, *extra])
    b = FigureGroup("paper_b", "paper B", ("moba", "ssa"), reference="ssa")
    assert [(r.report["run"], "dropped_mass" in r.report) for r in group_runs(runs, b)] == [("moba", True), ("ssa", False), ("ssa", False)]
    a = FigureGroup("paper_a", "paper A", ("dense", "fib"), reference="dense")
    made = plots.plot_all(runs, ["d"], tmp_path, reference=runs[0], groups=(a, b))
    names = [p.name for _, p in made]
    assert names[:4] == ["ppl_vs_length_paper_a.png", "posloss_paper_a.png", "ppl_vs_length_paper_b.png", "posloss_paper_b.png"]
    assert not (tmp_path / "ppl_vs_length.png").exists() and not (tmp_path / "posloss.png").exists()
    ppl_b, pos_b = drawn[2], drawn[3]
    assert ppl_b.get_suptitle() == "Perplexity vs evaluation length: paper B"
    assert [line.get_label() for line in ppl_b.axes[0].lines if not line.get_label().startswith("_")] == ["moba [law]", "ssa", "ssa [sparse]"]
    assert pos_b.axes[1].get_title() == "d: minus ssa (> 0: worse)"  # the group's reference, not the report's
    # fib's evaluation at more lengths is one line with its own, in both figures: one style each
    for fig in drawn[:2]:
        assert [line.get_label() for line in fig.axes[0].lines if not line.get_label().startswith("_")] == ["dense", "fib"]
        assert fig.axes[0].lines[0].get_color() != fig.axes[0].lines[1].get_color()
    with pytest.raises(ConfigError, match="names files"):
        FigureGroup("paper b", "x", ("a",))
    with pytest.raises(ConfigError, match="is not one of its runs"):
        FigureGroup("b", "x", ("a",), reference="dense")


def test_runs_past_the_palette_change_marker_as_well_as_line_style():
    styles = list(plots.run_styles([str(i) for i in range(10)]).values())
    assert styles[8].color == styles[0].color and styles[8].marker != styles[0].marker and styles[8].linestyle != styles[0].linestyle
    assert len({(s.color, s.marker) for s in styles}) == 10
