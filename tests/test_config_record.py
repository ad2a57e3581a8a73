"""Each checkpoint step records the model config it was saved with (issue 52): a config.json
edited since (fewer layers, other heads of the same shapes, another window) is refused by name
before anything is computed, with the checkpoint's value called the saved one; a parameter tree
is never restored in part; a step saved before the record is restored with one warning."""

import json
import shutil

import pytest

from fibjax.run import load as run_load
from fibjax.run.integrity import MODEL_FILE, SUMS_FILE, record_checksums
from fibjax.run.workdir import CheckpointError
from tests.helpers import assert_one_error, finished_tiny_run, train_main

SETTINGS = ("steps=2", "checkpoint.every_steps=2", "eval.max_tokens=512")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    """A finished tiny run (2 layers, 2 heads, 1 key-value head), copied by each test."""
    return finished_tiny_run(tmp_path_factory.mktemp("record") / "run", data_dir, *SETTINGS)


@pytest.fixture
def run(tmp_path, finished):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def edit(workdir, **model):
    config = json.loads((workdir / "config.json").read_text())
    for key, value in model.items():
        *parents, last = key.split("__")
        node = config["model"]
        for parent in parents:
            node = node[parent]
        node[last] = value
    (workdir / "config.json").write_text(json.dumps(config))


def without_record(workdir):
    """The run as fibjax wrote it before steps recorded their model."""
    step = workdir / "checkpoints" / "2"
    (step / MODEL_FILE).unlink()
    record_checksums(step)
    assert MODEL_FILE not in json.loads((step / SUMS_FILE).read_text())


def test_a_step_records_its_model_and_its_checksums_cover_the_record(run):
    step = run / "checkpoints" / "2"
    record = json.loads((step / MODEL_FILE).read_text())
    assert record["num_layers"] == 2 and record["num_heads"] == 2 and "attention.window" in record
    assert "remat" not in record  # a field a resume may change
    assert MODEL_FILE in json.loads((step / SUMS_FILE).read_text())


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"num_layers": 1}, "model.num_layers: 2 (saved with the checkpoint) vs 1 (in "),
        ({"num_heads": 4, "num_kv_heads": 2}, "model.num_heads: 2 (saved with the checkpoint) vs 4"),  # the same shapes
        ({"attention__window": 4}, "model.attention.window: 8 (saved with the checkpoint) vs 4"),
    ],
)
def test_an_evaluation_of_a_step_with_an_edited_config_is_refused_naming_the_fields(run, capsys, change, fragment):
    from launch.eval import main

    edit(run, **change)
    rc = main(["--workdir", str(run)])
    captured = capsys.readouterr()
    line = assert_one_error(rc, captured.out + captured.err, "checkpoint step 2", "was saved with another model", fragment, "put back the config")
    assert "config.json" in line and not (run / "eval").exists()


def test_evaluation_overrides_stay_allowed(run, capsys):
    from launch.eval import main

    assert main(["--workdir", str(run), "--lengths", "32", "--max-tokens", "256", "--attention", "window=4", "--rope", "theta=40000"]) == 0
    (report,) = (run / "eval").glob("2-*.json")
    assert json.loads(report.read_text())["attention"]["window"] == 4


def test_a_resume_with_an_edited_config_and_a_matching_override_is_refused_truthfully(run, data_dir, capsys):
    """Before, num_heads 2 -> 4 and num_kv_heads 1 -> 2 (the same shapes) resumed on reinterpreted
    weights; with the original command the refusal called the edited value "saved"."""
    edit(run, num_heads=4, num_kv_heads=2)
    rc, out = train_main(capsys, run, data_dir, *SETTINGS, "steps=4", "model.num_heads=4", "model.num_kv_heads=2")
    heads = "model.num_heads: 2 (saved with the checkpoint) vs 4 (in config.json)"
    assert_one_error(rc, out, "config.json no longer describes the model its checkpoint step 2", heads)
    rc, out = train_main(capsys, run, data_dir, *SETTINGS, "steps=4")  # the original command
    line = assert_one_error(rc, out, heads)
    assert "(saved) " not in line


def test_a_step_without_a_record_is_never_restored_in_part(run):
    """Before, 4 -> 2 layers in config.json evaluated the first 2 of the 4 trained blocks."""
    without_record(run)
    edit(run, num_layers=1)
    with pytest.raises(CheckpointError, match=r"holds \d+ parameter\(s\) the model in .*config.json does not have, e.g. params/blocks/1/"):
        run_load.load_run(run)


def test_a_step_without_a_record_restores_with_one_warning(run, capsys):
    without_record(run)
    assert run_load.load_run(run).step == 2
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "records no model config" in err and "names and shapes are checked" in err, err
