"""A newcomer's first mistakes get one short line that says what to do: a bad flag, a config typo
(before JAX is imported, with the key meant), Hugging Face sources without a network, training
on a data directory that was never prepared."""

import socket
import subprocess
import sys

import pytest

from fibjax.config import ConfigError, apply_overrides, load_config_file
from fibjax.data import DataError, prepare
from tests.helpers import ROOT


def test_an_argparse_error_is_one_line_pointing_at_help():
    done = subprocess.run([sys.executable, "-m", "launch.eval", "--workdir", "runs/x", "--lengths", "0"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: argument --lengths:"), done.stderr
    assert "python -m launch.eval --help" in done.stderr


def test_a_config_typo_is_reported_before_jax_is_imported_with_the_key_meant():
    code = "import sys; from launch.train import main; rc = main(['model.atention.window=3']); print(rc, 'jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "did you mean model.attention?" in done.stderr and done.stderr.count("\n") == 1


def test_no_suggestion_for_a_key_nothing_like_a_real_one():
    with pytest.raises(ConfigError) as e:
        apply_overrides(load_config_file(ROOT / "configs" / "tiny.py"), ["zzzz=1"])
    assert "did you mean" not in str(e.value)


def test_train_help_names_data_path_and_the_config_reference():
    done = subprocess.run([sys.executable, "-m", "launch.train", "--help"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "data.path=" in done.stdout and "docs/reference/config.md" in done.stdout


def test_hugging_face_sources_offline_fail_at_once_and_leave_nothing(tmp_path, monkeypatch):
    pytest.importorskip("datasets")

    def unreachable(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    out = tmp_path / "data" / "paper"
    with pytest.raises(DataError, match=r"cannot reach the Hugging Face Hub \(huggingface.co: Name or service not known\)"):
        prepare(out, {"tinystories": "hf:roneneldan/TinyStories"}, vocab_size=256, max_docs=10, progress=False)
    assert not out.exists() and not out.parent.exists()


def test_training_on_other_data_does_not_suggest_the_configs_own_prepare_command(tmp_path):
    cfg = str(ROOT / "configs" / "cpu" / "dense.py")
    err = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", cfg, "--workdir", str(tmp_path / "run"), f"data.path={tmp_path / 'mine'}", "data.weights="],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stderr
    assert err.startswith("error: data directory") and "--out data/cpu" not in err, err
    assert f"--out {tmp_path / 'mine'}" in err and "docs/guides/your-own-data.md" in err
