"""fibjax.study / launch.study: run states, the study's record surviving a new machine, and one
end-to-end study of two tiny runs (train, evaluate, report, rerun skips)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fibjax.config import ConfigError
from fibjax.study import RESTORED, Study, StudyError, StudyRun, format_status, restore_recorded, run_one, run_status, set_aside_restored, write_results
from tests.helpers import ATTN, ROOT, TINY_RUN, rows_for
from tests.tiers import slow

TINY = str(ROOT / "configs" / "tiny.py")


def make_study(tmp_path, overrides=("steps=100",)) -> Study:
    runs = (StudyRun("dense", TINY, ("model.attention.kind=dense",)), StudyRun("fib", TINY), StudyRun("fib_seed2", TINY, ("seed=2",), stage=2))
    return Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=overrides, reference="dense")


def finish(study: Study, name: str, ppls, step: int = 100):
    """A run directory as launch.train + launch.eval leave it (eval JSON, metrics with a val curve)."""
    run_dir = study.run_dir(next(r for r in study.runs if r.name == name))
    (run_dir / "eval").mkdir(parents=True)
    report = {
        "run": name,
        "step": step,
        "train_seq_len": 256,
        "lengths": [256, 512, 1024],
        "attention": ATTN,
        "attention_override": False,
        "alphas": [1.0, 1.0],
        "datasets": {"fineweb": rows_for(ppls, train_len=256)},
    }
    (run_dir / "eval" / f"{step}.json").write_text(json.dumps(report))
    rows = [{"step": s, "loss": 5.0 - s / 100, "ce": 5.0 - s / 100, "tokens_per_s": 7000.0} for s in range(1, step + 1)]
    rows += [{"step": s, "val/fineweb": 4.0 - s / 200} for s in (50, 100)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_select_and_states(tmp_path):
    study = make_study(tmp_path)
    assert [r.name for r in study.select(stage=1)] == ["dense", "fib"] and [r.name for r in study.select(["fib_seed2"])] == ["fib_seed2"]
    with pytest.raises(ConfigError, match=r"unknown run\(s\) \['nope'\]"):
        study.select(["fib", "nope"])
    with pytest.raises(ConfigError, match="must be unique"):
        Study(name="t", runs=(StudyRun("a", TINY), StudyRun("a", TINY)))
    finish(study, "dense", [30.0, 45.0, 90.0])
    fib = study.run_dir(study.runs[1])
    fib.mkdir(parents=True)
    (fib / "metrics.jsonl").write_text(json.dumps({"step": 40, "loss": 4.0, "tokens_per_s": 5000.0}) + "\n{torn")
    study.lock(study.runs[2]).write_text(str(os.getpid()))  # a live process holds fib_seed2
    states = {s.run.name: s for s in (run_status(study, r) for r in study.runs)}
    assert {n: s.state for n, s in states.items()} == {"dense": "done", "fib": "to do", "fib_seed2": "running"}
    assert states["fib"].step == 40 and states["fib"].tokens == 40 * 16 * 256
    table = format_status(study, list(states.values()))
    assert "| fib | 1 | to do | 40/100 |" in table and "1/3 done" in table


def test_the_record_rebuilds_finished_runs_on_a_new_machine(tmp_path, capsys):
    study = make_study(tmp_path)
    finish(study, "dense", [30.0, 45.0, 90.0])
    finish(study, "fib", [32.0, 31.5, 31.2])
    write_results(study)
    results = Path(study.results)
    before = {p.name: p.read_text() for p in results.glob("*.csv")}
    assert json.loads((results / "study.json").read_text())["runs"]["fib_seed2"]["state"] == "to do"

    import shutil

    shutil.rmtree(study.workdir)  # a new machine: the committed results, no run directories
    assert restore_recorded(study) == ["dense", "fib"]
    assert "restored from" in capsys.readouterr().out
    assert all(run_status(study, r).state == "done" for r in study.runs[:2]) and run_status(study, study.runs[2]).state == "to do"
    assert (study.run_dir(study.runs[0]) / RESTORED).exists() and "done (restored)" in format_status(study, [run_status(study, study.runs[0])])
    write_results(study)
    assert {p.name: p.read_text() for p in results.glob("*.csv")} == before
    val = [json.loads(line) for line in (study.run_dir(study.runs[1]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val if "val/fineweb" in r] == [50, 100] and [r["step"] for r in val if "loss" in r][:2] == [10, 20]

    # an existing directory is never touched, and a record made with other settings is not used
    assert restore_recorded(study) == []
    shutil.rmtree(study.workdir)
    changed = make_study(tmp_path, overrides=("steps=100", "optim.lr=0.01"))
    assert restore_recorded(changed, say=lambda m: print(m)) == []
    assert "another config, overrides or steps; not restored" in capsys.readouterr().out and not Path(study.workdir).exists()

    (results / "study.json").write_text("{torn")
    with pytest.raises(StudyError, match="not a study summary"):
        restore_recorded(study)


def test_retrain_sets_a_restored_run_aside_and_never_a_trained_one(tmp_path, capsys):
    """``launch.study --retrain``: a run restored from the record (no checkpoints) is trained
    again here; its restored copy is kept beside it, and a run trained here is never moved."""
    study = make_study(tmp_path)
    finish(study, "dense", [30.0, 45.0, 90.0])
    write_results(study)
    import shutil

    shutil.rmtree(study.workdir)
    restore_recorded(study)
    dense, fib = study.runs[0], study.runs[1]
    aside = set_aside_restored(study, dense, say=print)
    assert aside == study.run_dir(dense).with_name("dense.restored") and (aside / RESTORED).exists()
    assert not study.run_dir(dense).exists() and run_status(study, dense).state == "to do"
    assert "training it again" in capsys.readouterr().out
    # while it trains again, the report and the record keep the restored copy's figures
    recorded = json.loads((Path(study.results) / "study.json").read_text())["runs"]["dense"]
    study.run_dir(dense).mkdir(parents=True)
    (study.run_dir(dense) / "metrics.jsonl").write_text(json.dumps({"step": 40, "loss": 4.0, "tokens_per_s": 5000.0}) + "\n")
    write_results(study)
    kept = json.loads((Path(study.results) / "study.json").read_text())["runs"]["dense"]
    assert kept["state"] == "done" and kept["evals"] == recorded["evals"] and kept["val_curve"] == recorded["val_curve"]
    assert "| dense |" in (Path(study.results) / "report.md").read_text()
    finish(study, "fib", [32.0, 31.5, 31.2])  # trained here: left alone
    assert set_aside_restored(study, fib) is None and (study.run_dir(fib) / "eval").exists()
    broken = study.run_dir(dense)
    (broken / "checkpoints").mkdir(parents=True)
    (broken / RESTORED).write_text("x")
    with pytest.raises(StudyError, match="both a RESTORED marker and checkpoints"):
        set_aside_restored(study, dense)


def test_a_killed_study_s_training_time_is_counted_when_the_run_is_taken_up_again(tmp_path):
    """A study killed outright (SIGKILL, a machine's session ending) never added that session's
    training time, so a resumed run's ``train_s`` held only its last session (1 h 32 min for a
    2 h 23 min run). The stale lock it leaves dates the session's start and the metrics its last
    step: the next study adds that span once, and nothing for a lock older than the metrics."""
    study = make_study(tmp_path)
    dense = study.runs[0]
    run_dir = finish(study, "dense", [30.0, 45.0, 90.0])  # trained to the end; only the time is missing
    (run_dir / "study_time.json").write_text(json.dumps({"train_s": 1000.0}))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    lock = study.lock(dense)
    lock.write_text(dead)
    now = time.time()
    os.utime(lock, (now - 100, now - 100))
    os.utime(run_dir / "metrics.jsonl", (now - 40, now - 40))
    run_one(study, dense, say=lambda _m: None)
    timing = json.loads((run_dir / "study_time.json").read_text())
    assert timing["train_s"] == pytest.approx(1060.0, abs=0.2) and not lock.exists()
    run_one(study, dense, say=lambda _m: None)  # no stale lock: nothing added again
    assert json.loads((run_dir / "study_time.json").read_text())["train_s"] == pytest.approx(1060.0, abs=0.2)
    lock.write_text(dead)  # killed while evaluating, after its metrics' last write: no training time
    os.utime(lock, (now - 10, now - 10))
    run_one(study, dense, say=lambda _m: None)
    assert json.loads((run_dir / "study_time.json").read_text())["train_s"] == pytest.approx(1060.0, abs=0.2)


def test_an_evaluation_added_to_a_restored_run_keeps_its_record_until_it_is_retrained(tmp_path):
    """A study that adds an evaluation to a run it only has from the record: the run says it
    needs ``--retrain``, refuses to evaluate a checkpoint it does not have, and the report and
    the record keep what was recorded (nothing saved is lost by rewriting them)."""
    study = make_study(tmp_path)
    finish(study, "dense", [30.0, 45.0, 90.0])
    finish(study, "fib", [32.0, 31.5, 31.2])
    write_results(study)
    results = Path(study.results)
    import shutil

    shutil.rmtree(study.workdir)
    restore_recorded(study)
    added = ("--lengths", "2048")
    runs = (dataclasses.replace(study.runs[0], extra_evals=(added,)), *study.runs[1:])
    grown = dataclasses.replace(study, runs=runs)
    dense = grown.runs[0]
    assert run_status(grown, dense).state == "to do"
    assert "to do (restored without checkpoints: --retrain)" in format_status(grown, [run_status(grown, dense)])
    with pytest.raises(StudyError, match="--retrain --only dense"):
        run_one(grown, dense)
    write_results(grown)
    entry = json.loads((results / "study.json").read_text())["runs"]["dense"]
    assert entry["state"] == "done" and list(entry["evals"]) == ["100.json"] and entry["evals_missing"] == ["100-study-lengths_2048.json"]
    assert "| dense |" in (results / "report.md").read_text()
    shutil.rmtree(grown.workdir)  # and a new machine still restores it from that record
    assert restore_recorded(grown, say=lambda _m: None) == ["dense", "fib"]


def test_a_runs_extra_evaluations_are_rows_of_the_report(tmp_path):
    """Paper B's runs are evaluated again under sparse inference and RoPE scaling: those evaluations
    are reported beside the run's own, each as "RUN [tag]"."""
    sparse = (("--inference-mode", "sparse"),)
    runs = (StudyRun("dense", TINY, ("model.attention.kind=dense",), extra_evals=sparse),)
    study = Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=("steps=100",))
    run_dir = finish(study, "dense", [30.0, 45.0, 90.0])
    assert run_status(study, runs[0]).state == "to do"  # its extra evaluation is missing
    extra = json.loads((run_dir / "eval" / "100.json").read_text())
    extra["datasets"]["fineweb"] = rows_for([33.0, 40.0, 60.0], train_len=256)
    (run_dir / "eval" / "100-study-inference-mode_sparse.json").write_text(json.dumps(extra))
    assert run_status(study, runs[0]).state == "done"
    write_results(study)
    matrix = (Path(study.results) / "matrix.csv").read_text()
    assert "dense [study-inference-mode_sparse]" in matrix and "33.0" in matrix and "30.0" in matrix
    assert set(json.loads((Path(study.results) / "study.json").read_text())["runs"]["dense"]["evals"]) == {"100.json", "100-study-inference-mode_sparse.json"}


@slow
def test_launch_study_end_to_end(tmp_path):
    """Two tiny runs through `python -m launch.study`: trained and evaluated as child commands, the
    report written; run again, both are skipped; --status says done."""
    small = ["steps=3", *TINY_RUN, "eval.max_tokens=1024", "eval.length_multipliers=(1,2)", f"data.path={tmp_path / 'data'}"]
    from fibjax.data.prepare import prepare_default

    prepare_default(tmp_path / "data", vocab_size=384)  # both runs read one prepared corpus
    study_file = tmp_path / "study.py"
    study_file.write_text(
        "from fibjax.study import Study, StudyRun\n"
        f"def get_study():\n    return Study(name='e2e', workdir={str(tmp_path / 'runs')!r}, results={str(tmp_path / 'results')!r},\n"
        f"        overrides={tuple(small)!r}, reference='dense',\n"
        f"        runs=(StudyRun('dense', {TINY!r}, ('model.attention.kind=dense',)), StudyRun('fib', {TINY!r})))\n"
    )
    cmd = [sys.executable, "-m", "launch.study", str(study_file)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr + first.stdout
    summary = json.loads((tmp_path / "results" / "study.json").read_text())
    assert {n: e["state"] for n, e in summary["runs"].items()} == {"dense": "done", "fib": "done"}
    assert set(summary["runs"]["fib"]["evals"]) == {"3.json"} and (tmp_path / "results" / "extrap.csv").exists()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "[dense] done" in again.stdout and "[fib] done" in again.stdout and "training" not in again.stdout
    status = subprocess.run([*cmd, "--status"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "2/2 done" in status.stdout


def test_the_summary_keeps_the_error_law_points_only_where_the_plot_draws_them():
    from fibjax.study import _summary_of

    fit = {"slope": 0.36, "r2": 0.78, "queries": 4}
    points = {"points": {"mass": [0.1, 0.2], "error": [0.0, 0.1]}}
    law = {"fineweb": {"128": [{**fit, **points}], "256": [{**fit, **points}]}, "wiki": {"256": [{**fit, **points}]}}
    report = {"train_seq_len": 256, "error_law": law}
    assert _summary_of(report)["error_law"] == {"fineweb": {"128": [fit], "256": [{**fit, **points}]}, "wiki": {"256": [fit]}}
    assert "points" in report["error_law"]["wiki"]["256"][0]  # the run's own report is untouched
    # not evaluated at the training length: the plot draws the first length, and so keeps it
    shorter = {"train_seq_len": 512, "error_law": {"fineweb": {"128": [{**fit, **points}], "256": [{**fit, **points}]}}}
    assert _summary_of(shorter)["error_law"] == {"fineweb": {"128": [{**fit, **points}], "256": [fit]}}
    assert _summary_of({"step": 9}) == {"step": 9}


def test_a_run_restored_from_the_summary_draws_the_same_error_law_plot(tmp_path):
    from fibjax.eval.plots import plot_error_law
    from fibjax.eval.report import RunEval
    from fibjax.study import _summary_of

    rng = np.random.default_rng(0)

    def layer(slope):
        mass = rng.uniform(0, 1, 64)
        return {"slope": slope, "r2": 0.9, "points": {"mass": mass.tolist(), "error": (slope * mass + rng.normal(0, 0.02, 64)).tolist()}}

    report = {"train_seq_len": 256, "error_law": {ds: {n: [layer(0.3), layer(0.5)] for n in ("256", "512")} for ds in ("fineweb", "wiki")}}
    drawn = []
    for i, rep in enumerate((report, _summary_of(report))):
        assert plot_error_law([RunEval("ssa", tmp_path, tmp_path, rep, [])], tmp_path / f"{i}.png")
        drawn.append((tmp_path / f"{i}.png").read_bytes())
    assert drawn[0] == drawn[1]


def test_status_writes_nothing_and_counts_recorded_runs_as_done(tmp_path):
    """--status on a machine without the runs (a fresh clone): the record's finished runs read as
    done (restored) and nothing is created; a run still to train names its missing data."""
    study = make_study(tmp_path, overrides=("steps=100", f"data.path={tmp_path / 'no-data'}"))
    finish(study, "dense", [30.0, 45.0, 90.0])
    finish(study, "fib", [32.0, 31.5, 31.2])
    write_results(study)
    import shutil

    shutil.rmtree(study.workdir)
    cmd = [sys.executable, "-m", "launch.study", str(write_study_file(tmp_path, study)), "--status"]
    before = sorted(p for p in tmp_path.rglob("*"))
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p for p in tmp_path.rglob("*") if p.name != "__pycache__" and "__pycache__" not in p.parts) == before
    assert "| dense | 1 | done (restored) |" in out.stdout and "2/3 done" in out.stdout
    assert f"to do; data missing: {tmp_path / 'no-data'}" in out.stdout and "data missing:" in out.stdout.splitlines()[-1]


def write_study_file(tmp_path, study: Study) -> Path:
    path = tmp_path / "study_file.py"
    runs = ", ".join(f"StudyRun({r.name!r}, {r.config!r}, {r.overrides!r}, stage={r.stage})" for r in study.runs)
    path.write_text(
        "from fibjax.study import Study, StudyRun\n"
        f"def get_study():\n    return Study(name={study.name!r}, workdir={study.workdir!r}, results={study.results!r},\n"
        f"        overrides={study.overrides!r}, reference={study.reference!r}, runs=({runs},))\n"
    )
    return path


def test_eta_uses_the_studys_finished_runs_and_the_record_keeps_their_speed(tmp_path):
    study = make_study(tmp_path)
    finish(study, "dense", [30.0, 45.0, 90.0])  # 7,000 tokens/s in its metrics
    statuses = [run_status(study, r) for r in study.runs]
    assert statuses[0].tokens_per_s == 7000.0
    table = format_status(study, statuses)
    assert "runs not started at 7,000 tok/s, the median of its finished runs" in table
    per_run = 100 * 16 * 256 / 7000  # the tiny config's batch 16 x 256 tokens, 100 steps
    assert table.count(f"| {round(per_run / 60)}m |") == 2
    write_results(study)
    assert json.loads((Path(study.results) / "study.json").read_text())["runs"]["dense"]["tokens_per_s"] == 7000.0
    nothing = Study(name="t", runs=study.runs[2:], workdir=str(tmp_path / "other"), results=str(tmp_path / "r2"), overrides=("steps=100",))
    assert "2,700 tok/s, a guess" in format_status(nothing, [run_status(nothing, r) for r in nothing.runs])


def test_the_report_tests_paired_models_across_seeds(tmp_path):
    """Seeds of two models become the paired test's rows (from the main evaluation and from an
    extra one that only adds lengths); a run with other overrides of its own is left out."""
    from fibjax.eval.paired import Comparison

    long = (("--lengths", "256,4096"),)
    runs = (
        StudyRun("a", TINY, ()),
        StudyRun("b", TINY.replace("tiny", "tiny"), ("model.attention.alpha=fixed",)),
        StudyRun("a_seed43", TINY, ("seed=43",), extra_evals=long),
    )
    study = Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=("steps=100",))
    assert study.model_and_seed(runs[0]) == (TINY, 42) and study.model_and_seed(runs[1]) is None and study.model_and_seed(runs[2]) == (TINY, 43)
    finish(study, "a", [30.0, 29.0, 28.0])
    run_dir = finish(study, "a_seed43", [31.0, 30.0, 29.0])
    extra = json.loads((run_dir / "eval" / "100.json").read_text())
    extra["datasets"]["fineweb"] = [{**extra["datasets"]["fineweb"][0], "length": 4096, "nll": 9.0}]
    (run_dir / "eval" / "100-study-lengths_256,4096.json").write_text(json.dumps(extra))
    from fibjax.study import paired_nlls

    statuses = {r.name: run_status(study, r) for r in runs}
    nlls = paired_nlls(study, list(runs), statuses)
    assert sorted(nlls[TINY]) == [42, 43] and nlls[TINY][43]["fineweb"][4096] == 9.0
    assert nlls[TINY][43]["fineweb"][256] == pytest.approx(np.log(31.0))
    with_test = Study(**{**study.__dict__, "comparisons": (Comparison("a - a", TINY, TINY),)})
    write_results(with_test)
    report = (Path(study.results) / "report.md").read_text()
    assert "## Paired tests across seeds" in report and "| a - a | fineweb | 256 (1x) | 2 | 42: +0.0000, 43: +0.0000 |" in report
    assert (Path(study.results) / "paired.png").exists() and (Path(study.results) / "paired.csv").exists()


def test_the_report_draws_extrapolation_against_the_training_length(tmp_path):
    """A trend's runs (seeds at 256, one run at 512) become one point per training length and
    multiple: the mean over seeds of the perplexity change at m x that length, from each run's own
    lengths; a run the study has not finished is left out, and an unknown run name is refused."""
    from fibjax.eval.trend import Trend

    runs = (StudyRun("a", TINY), StudyRun("a_seed43", TINY, ("seed=43",)), StudyRun("a_512", TINY, ("seq_len=512",)), StudyRun("a_todo", TINY, ("seed=44",)))
    trends = (Trend("a", ("a", "a_seed43", "a_512", "a_todo")),)
    study = Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=("steps=100",), trends=trends)
    finish(study, "a", [30.0, 33.0, 36.0])  # +10%, +20%
    finish(study, "a_seed43", [30.0, 36.0, 39.0])  # +20%, +30%
    run_dir = finish(study, "a_512", [20.0, 30.0, 40.0])
    report = json.loads((run_dir / "eval" / "100.json").read_text())
    report.update(train_seq_len=512, datasets={"fineweb": rows_for([20.0, 30.0, 40.0], train_len=512)})  # +50%, +100%
    (run_dir / "eval" / "100.json").write_text(json.dumps(report))
    write_results(study)
    out = Path(study.results)
    text = (out / "report.md").read_text()
    assert "## Extrapolation against the training length" in text
    assert "| a | 256 | 2 | +15.0% | +10.0 .. +20.0 | 2 | a, a_seed43 |" in text
    assert "| a | 256 | 4 | +25.0% | +20.0 .. +30.0 | 2 | a, a_seed43 |" in text
    assert "| a | 512 | 4 | +100.0% |  | 1 | a_512 |" in text and "a_todo" not in text
    assert (out / "length_trend.png").stat().st_size > 0 and len((out / "length_trend.csv").read_text().splitlines()) == 1 + 6
    with pytest.raises(ConfigError, match="trends name runs it does not have"):
        Study(name="t", runs=runs, trends=(Trend("x", ("a", "nope")),))


def test_a_trend_point_needs_every_dataset_at_both_lengths():
    from fibjax.eval.trend import Trend, points, ppl_change

    nll = {"x": {256: 1.0, 1024: 1.0 + np.log(1.5)}, "y": {256: 2.0, 1024: 2.0}}
    assert ppl_change(nll, 256, 4, ["x", "y"]) == pytest.approx(100 * (1.5**0.5 - 1))  # geometric mean
    assert ppl_change(nll, 256, 2, ["x"]) is None  # 512 was not evaluated
    (only,) = points([Trend("t", ("r",))], {"r": (256, nll)}, ["x", "y"], multiples=(2, 4))  # no 2x point
    assert (only.train_len, only.multiple, only.runs, only.mean) == (256, 4, ("r",), pytest.approx(100 * (1.5**0.5 - 1)))


def test_a_studys_figure_groups_name_its_runs_and_draw_one_figure_each(tmp_path):
    from fibjax.eval.groups import FigureGroup

    groups = (FigureGroup("two", "dense and fib", ("dense", "fib"), reference="dense"), FigureGroup("seeds", "fib's seeds", ("fib", "fib_seed2")))
    base = make_study(tmp_path)
    study = Study(name="t", runs=base.runs, workdir=base.workdir, results=base.results, overrides=base.overrides, figures=groups)
    for name in ("dense", "fib", "fib_seed2"):
        finish(study, name, [30.0, 33.0, 36.0])
    write_results(study)
    out = Path(study.results)
    drawn = sorted(p.name for p in out.glob("*.png") if p.name.startswith(("ppl_vs_length", "posloss")))
    assert drawn == ["posloss_seeds.png", "posloss_two.png", "ppl_vs_length_seeds.png", "ppl_vs_length_two.png"]
    assert "![Perplexity vs evaluation length: dense and fib](ppl_vs_length_two.png)" in (out / "report.md").read_text()
    with pytest.raises(ConfigError, match="figures name runs it does not have: \\['nope'\\]"):
        Study(name="t", runs=study.runs, figures=(FigureGroup("x", "x", ("fib", "nope")),))
