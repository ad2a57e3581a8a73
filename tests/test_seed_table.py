"""fibjax.eval.seed_table and the study report's section on it: runs and their extra evaluations
side by side at several lengths, averaged over the seeds every row has."""

import csv
import json
import math
from pathlib import Path

import pytest

from fibjax.config import ConfigError
from fibjax.eval.seed_table import SeedRow, SeedTable, common_seeds, markdown, mean_ppl
from fibjax.study import Study, StudyRun, _extra_eval_path, write_results
from tests.test_study import TINY, finish

WINDOW = ("--attention", "kind=window", "window=4")


def nll(values):
    """nll[dataset][length] of one seed: ``values``: length -> perplexity on fineweb."""
    return {"fineweb": {n: math.log(p) for n, p in values.items()}}


def table(*rows, seeds=(1, 2)):
    return SeedTable("t", "a table", rows, seeds, lengths=(256, 1024))


def test_the_common_seeds_are_those_every_row_with_results_has_and_a_cell_is_exp_of_the_mean_nll():
    t = table(SeedRow("a", "a{seed}"), SeedRow("b", "b{seed}"), SeedRow("c", "c{seed}"), SeedRow("one", "one", seeds=(7,)))
    nlls = {
        "a": {1: nll({256: 10.0, 1024: 20.0}), 2: nll({256: 40.0, 1024: 20.0})},
        "b": {2: nll({256: 5.0})},  # only seed 2: the table's common seed
        "one": {7: nll({256: 3.0})},  # its own seed: outside the rule
    }  # c: not run yet, left out of the rule
    assert common_seeds(t, nlls) == (2,)
    assert mean_ppl(nlls["a"], (1, 2), "fineweb", 256) == pytest.approx(20.0)  # sqrt(10 * 40)
    assert mean_ppl(nlls["b"], (1, 2), "fineweb", 256) is None  # a seed missing: no mean
    text = markdown(t, nlls, ["fineweb"])
    assert "over seed 2 " in text
    assert "| a | 40.00 / 20.00 |" in text and "| b | 5.00 / - |" in text and "| c | not yet |" in text
    assert "| one (seed 7 only) | 3.00 / - |" in text
    assert common_seeds(t, {}) == () and "over no seed yet" in markdown(t, {}, ["fineweb"])


def test_a_seed_table_refuses_a_bad_name_repeated_labels_or_a_run_without_its_seed():
    with pytest.raises(ConfigError, match="letters, digits and _"):
        SeedTable("a-b", "t", (SeedRow("a", "a{seed}"),), (1,), (256,))
    with pytest.raises(ConfigError, match="distinct labels"):
        table(SeedRow("a", "a{seed}"), SeedRow("a", "b{seed}"))
    with pytest.raises(ConfigError, match="must name its one seed"):
        SeedRow("a", "dense")
    with pytest.raises(ConfigError, match="at least one seed"):
        SeedTable("t", "t", (SeedRow("a", "a{seed}"),), (), (256,))


def test_the_study_checks_a_tables_runs_and_evaluations():
    runs = (StudyRun("a_seed1", TINY, ("seed=1",), extra_evals=(WINDOW,)),)
    with pytest.raises(ConfigError, match=r"seed_tables name runs it does not have: \['a_seed2'\]"):
        Study(name="t", runs=runs, seed_tables=(table(SeedRow("a", "a_seed{seed}")),))
    with pytest.raises(ConfigError, match=r"row 'a, ntk': a_seed1 has no extra evaluation \['--rope'"):
        Study(name="t", runs=runs, seed_tables=(table(SeedRow("a, ntk", "a_seed{seed}", ("--rope", "scaling=ntk")), seeds=(1,)),))


def test_the_study_report_has_the_table_of_finished_runs_and_their_extra_evaluations(tmp_path):
    """Two seeds of a model, one under a window too (an extra evaluation), a model of one seed and
    a model not trained: the means over both seeds, the CSV with every seed then the mean."""
    runs = (
        StudyRun("a_seed1", TINY, ("seed=1",), extra_evals=(WINDOW,)),
        StudyRun("a_seed2", TINY, ("seed=2",), extra_evals=(WINDOW,)),
        StudyRun("b_seed1", TINY, ("seed=1",)),
        StudyRun("c_seed1", TINY, ("seed=1",)),
        StudyRun("c_seed2", TINY, ("seed=2",)),
    )
    rows = (SeedRow("a", "a_seed{seed}"), SeedRow("a, window 4", "a_seed{seed}", WINDOW), SeedRow("b", "b_seed1", seeds=(1,)), SeedRow("c", "c_seed{seed}"))
    t = SeedTable("base", "Baselines", rows, (1, 2), lengths=(256, 1024))
    study = Study(name="t", runs=runs, workdir=str(tmp_path / "runs"), results=str(tmp_path / "results"), overrides=("steps=100",), seed_tables=(t,))
    for name, ppls in (("a_seed1", [10.0, 30.0, 90.0]), ("a_seed2", [40.0, 30.0, 90.0]), ("b_seed1", [12.0, 12.0, 12.0])):
        run_dir = finish(study, name, ppls)
        if name.startswith("a_"):
            report = json.loads((run_dir / "eval" / "100.json").read_text())
            report["datasets"]["fineweb"] = [{**r, "nll": r["nll"] - math.log(2), "ppl": r["ppl"] / 2} for r in report["datasets"]["fineweb"]]
            report["attention_override"] = True
            _extra_eval_path(run_dir, 100, WINDOW).write_text(json.dumps(report))

    write_results(study)
    out = Path(study.results)
    text = (out / "report.md").read_text()
    assert "## Baselines" in text and "over seeds 1, 2 " in text
    assert "| a | 20.00 / 90.00 |" in text and "| a, window 4 | 10.00 / 45.00 |" in text  # 1x: sqrt(10 * 40); 4x (1,024)
    assert "| b (seed 1 only) | 12.00 / 12.00 |" in text and "| c | not yet |" in text
    table_rows = list(csv.DictReader((out / "seed_table_base.csv").open()))
    a = [(r["seed"], r["length"], r["ppl"]) for r in table_rows if r["row"] == "a"]
    per_seed = [("1", "256", "10.0000"), ("1", "1024", "90.0000"), ("2", "256", "40.0000"), ("2", "1024", "90.0000")]
    assert a == [*per_seed, ("mean 1 2", "256", "20.0000"), ("mean 1 2", "1024", "90.0000")]
    assert {r["run"] for r in table_rows if r["row"] == "a, window 4"} == {"a_seed1", "a_seed2", "a_seed{seed}"}
