"""Commands check what they will need before they work (a writable output, an intact step, a
directory for a workdir), and their messages say what is true and a remedy that works."""

import errno
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from fibjax.eval import runner
from fibjax.run import load as run_load
from fibjax.run.checkpoints import HELD_DIR, Checkpointer
from fibjax.run.integrity import finished_steps
from fibjax.run.workdir import CheckpointError
from tests.helpers import ROOT, assert_one_error, finished_tiny_run, flip_bytes, train_main

SETTINGS = ("steps=4", "checkpoint.every_steps=2", "eval.max_tokens=512")


@pytest.fixture(scope="module")
def run_of_4(tmp_path_factory, data_dir):
    """A finished tiny run with checkpoints at steps 2 and 4, copied by each test that changes it."""
    return finished_tiny_run(tmp_path_factory.mktemp("preflight") / "run", data_dir, *SETTINGS)


@pytest.fixture
def run_copy(tmp_path, run_of_4):
    shutil.copytree(run_of_4, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def read_only(tmp_path):
    """``read_only(directory)``: the directory bind-mounted read-only onto itself for the test."""
    mounted = []

    def make(directory):
        directory.mkdir(exist_ok=True)
        if subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True).returncode:
            pytest.skip("a read-only bind mount needs root and mount(8)")
        mounted.append(directory)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True, capture_output=True)
        return directory

    yield make
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def test_nothing_to_do_checks_the_last_step_first(run_copy, data_dir, capsys):
    """Before, a complete run whose last step was damaged said "nothing to do ... evaluate it with
    launch.eval", which then refused that step."""
    flip_bytes(run_copy / "checkpoints" / "4")
    rc, out = train_main(capsys, run_copy, data_dir, *SETTINGS)
    assert_one_error(rc, out, "is complete, but checkpoint step 4", "damaged", "--resume-step 2")


def test_an_evaluation_into_a_read_only_workdir_is_refused_before_it_evaluates(run_copy, read_only, monkeypatch, capsys):
    """Before, it evaluated (52 s in the issue) and then failed to write."""
    from launch.eval import main as eval_main

    monkeypatch.setattr(runner, "evaluate_run", lambda *a, **k: pytest.fail("evaluated before checking where the report goes"))
    read_only(run_copy)
    rc = eval_main(["--workdir", str(run_copy)])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.out + captured.err, "cannot write the evaluation report", "Read-only file system", "nothing was evaluated")


def test_a_read_only_empty_workdir_does_not_claim_saved_checkpoints(tmp_path, read_only, data_dir, capsys):
    workdir = read_only(tmp_path / "empty")
    rc, out = train_main(capsys, workdir, data_dir, "steps=2")
    line = assert_one_error(rc, out, "Read-only file system", "nothing was trained")
    assert "already saved" not in line


@pytest.mark.parametrize("where", ["run", "run/sub"])
def test_a_workdir_that_is_a_file_is_named_as_such(tmp_path, data_dir, capsys, where):
    (tmp_path / "run").write_text("not a directory")
    rc, out = train_main(capsys, tmp_path / where, data_dir, "steps=2")
    assert_one_error(rc, out, f"{tmp_path / 'run'} is a file, not a directory", "another --workdir")


def test_evaluating_a_run_without_checkpoints_creates_nothing_and_says_what_to_do(tmp_path, run_of_4, capsys):
    from launch.eval import main as eval_main

    workdir = tmp_path / "new"
    workdir.mkdir()
    shutil.copy(run_of_4 / "config.json", workdir)
    rc = eval_main(["--workdir", str(workdir)])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.out + captured.err, "no finished checkpoint yet", "step 2", "train it")
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]


def test_evaluations_of_other_data_under_one_name_write_other_files(run_copy, data_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    paths = [runner.evaluate_workdir(run_copy, lengths=[32], specs={"web": str(d)}, max_tokens=256)[1] for d in (data_dir, other)]
    assert paths[0] != paths[1] and all(p.is_file() for p in paths), paths
    assert [json.loads(p.read_text())["data"]["web"] for p in paths] == [str(data_dir), str(other)]


@pytest.fixture
def step_4_deleted_while_read(run_copy, monkeypatch):
    """Step 4 of the run deleted (as checkpoint.keep of a run training beside it does) as it is read."""
    restore = Checkpointer.restore_params

    def deleted_while_read(self, step, abstract):
        if step == 4 and (run_copy / "checkpoints" / "4").exists():
            shutil.rmtree(run_copy / "checkpoints" / "4")
        return restore(self, step, abstract)

    monkeypatch.setattr(Checkpointer, "restore_params", deleted_while_read)


def test_an_evaluation_holds_the_step_it_reads_against_deletion(run_copy, step_4_deleted_while_read):
    """Before, 6 of 6 evaluations beside a run with checkpoint.keep=1 checkpoint.every_steps=1
    failed, some calling the intact step "damaged"."""
    run = run_load.load_run(run_copy)
    assert run.step == 4 and finished_steps(run_copy) == [2]
    assert not (run_copy / HELD_DIR).exists()  # the links are gone with the evaluation


@pytest.fixture
def no_hard_links(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)


def test_where_it_cannot_be_held_a_deleted_step_is_replaced_by_the_latest_saying_so(run_copy, no_hard_links, step_4_deleted_while_read, capsys):
    run = run_load.load_run(run_copy)
    assert run.step == 2
    assert "checkpoint step 4 was deleted while it was read (checkpoint.keep=2); reading step 2, now the latest" in capsys.readouterr().err


def test_where_it_cannot_be_held_a_given_step_deleted_while_read_is_an_error(run_copy, no_hard_links, step_4_deleted_while_read):
    with pytest.raises(CheckpointError, match=r"step 4 in .* was deleted while it was read .* its steps now: \[2\]: evaluate one of them with --step"):
        run_load.load_run(run_copy, 4)


def test_a_config_edited_to_another_model_is_not_called_damaged(run_copy, data_dir, capsys):
    """config.json edited to d_model 64 and resumed with a matching override: before, the intact
    steps were called "damaged" with the advice --resume-step 2, then a new --workdir. The step's
    model record names the field, with the checkpoint's value as the saved one."""
    config = json.loads((run_copy / "config.json").read_text())
    config["model"]["d_model"] = 64
    (run_copy / "config.json").write_text(json.dumps(config))
    rc, out = train_main(capsys, run_copy, data_dir, *SETTINGS, "steps=6", "model.d_model=64")
    line = assert_one_error(
        rc,
        out,
        "config.json no longer describes the model its checkpoint step 4",
        "model.d_model: 32 (saved with the checkpoint) vs 64 (in config.json)",
        "put back the config",
    )
    assert "damaged" not in line and "--resume-step" not in line and "new --workdir" not in line


def test_an_evaluation_on_a_full_disk_is_refused_before_it_evaluates(run_copy, monkeypatch, capsys):
    """Before, the check made an empty file, which a full disk allows: 12.9 s of evaluation, the
    table, then the failed write. ``eval/`` here is a 64 KiB tmpfs filled to the last byte."""
    from launch.eval import main

    eval_dir = run_copy / "eval"
    eval_dir.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(eval_dir)], capture_output=True).returncode:
        pytest.skip("a small tmpfs needs root and mount(8)")
    try:
        with open(eval_dir / "filler", "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 4096)
        monkeypatch.setattr(runner, "evaluate_run", lambda *a, **k: pytest.fail("evaluated"))
        rc = main(["--workdir", str(run_copy)])
        captured = capsys.readouterr()
        assert_one_error(rc, captured.out + captured.err, f"no room for the evaluation report in {eval_dir}", "nothing was evaluated")
        assert sorted(p.name for p in eval_dir.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(eval_dir)], capture_output=True)


def test_a_damaged_last_step_lists_the_runs_real_steps(run_copy, capsys):
    """Before, the message listed the held copy's steps: "other steps: []" while step 2 was intact."""
    from launch.eval import main

    flip_bytes(run_copy / "checkpoints" / "4")
    rc = main(["--workdir", str(run_copy)])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.out + captured.err, "checkpoint step 4", "is damaged", "other steps: [2]", "--step 2")


def test_two_evaluations_writing_one_report_use_temporary_files_of_their_own(tmp_path, monkeypatch):
    names = []
    real_replace = os.replace
    monkeypatch.setattr(runner.os, "replace", lambda a, b: names.append(a) or real_replace(a, b))
    report = {"step": 4, "datasets": {}}
    runner.write_report(tmp_path, report)
    runner.write_report(tmp_path, report)
    assert len(set(names)) == 2 and json.loads((tmp_path / "eval" / "4.json").read_text()) == report
    assert not [p for p in (tmp_path / "eval").iterdir() if p.name != "4.json"]


def test_an_imported_run_without_data_is_one_error_naming_the_data_to_pass(run_copy, capsys):
    """Before: exit 0, an empty table and eval/0.json. The remedy it names was run by hand (an
    import's data directory holds its tokenizer only; launch.prepare_data --tokenizer FILE)."""
    from fibjax.data.prepare import prepare_tokenizer_only
    from fibjax.data.token_files import data_tokenizer
    from launch.eval import main

    config = json.loads((run_copy / "config.json").read_text())
    tokenizer = data_tokenizer(config["data"]["path"])
    config["data"]["path"] = str(run_copy / "data")
    (run_copy / "config.json").write_text(json.dumps(config))
    prepare_tokenizer_only(run_copy / "data", tokenizer, "a Hugging Face model")
    (run_copy / "data.sha256.json").unlink()
    (run_copy / "hf_source.json").write_text("{}")
    rc = main(["--workdir", str(run_copy)])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.out + captured.err, "was imported from Hugging Face", "--tokenizer", "--data NAME=DIR")
    assert not (run_copy / "eval").exists()


def test_lengths_too_long_together_name_their_least_common_multiple_and_what_to_pass(run_copy, capsys):
    from launch.eval import main

    rc = main(["--workdir", str(run_copy), "--lengths", "256,300"])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.out + captured.err, "least common multiple (19200 tokens)", "e.g. 256,512")


@pytest.mark.parametrize("given, fragment", [("configs/tiny", "did you mean --config configs/tiny.py?"), ("configs/cpu", "is a folder")])
def test_a_config_named_without_py_suggests_the_file(given, fragment, capsys):
    from launch.train import main

    rc = main(["--config", given])
    captured = capsys.readouterr()
    line = assert_one_error(rc, captured.out + captured.err, fragment)
    assert "fibjax/configs" not in line


def test_a_fibjax_folder_where_the_command_runs_is_one_error(tmp_path):
    """Before: a raw ModuleNotFoundError (the folder, first on Python's path, hides the package)."""
    (tmp_path / "fibjax").mkdir()
    (tmp_path / "fibjax" / "__init__.py").write_text("")
    # as with fibjax installed from a wheel: this venv's editable install finds fibjax before the folder
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])}
    proc = subprocess.run([sys.executable, "-S", "-m", "launch.eval", "--workdir", "x"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_one_error(proc.returncode, proc.stdout + proc.stderr, "a folder named fibjax/", "from another directory")
