"""Continual training (``init_from=RUN[:STEP]``) and RoPE overrides at evaluation (``--rope``).

A run continued at a longer length starts from exactly the source's parameters, with a fresh
optimizer; a change that alters parameter shapes is refused before anything is written.
"""

import json

import jax
import numpy as np
import pytest

from fibjax import sharding
from fibjax.config import ConfigError, apply_overrides, load_config_file
from fibjax.run.checkpoints import Checkpointer
from fibjax.run.workdir import CheckpointError
from fibjax.train import init_from
from fibjax.train.metrics import read_metrics
from fibjax.train.step import build
from tests.helpers import ROOT, TINY, assert_one_error, train_main


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, data_dir):
    from launch.train import main

    workdir = tmp_path_factory.mktemp("runs") / "source"
    assert main(["--workdir", str(workdir), "--no-progress", *TINY, f"data.path={data_dir}", "steps=6", "checkpoint.every_steps=3"]) == 0
    return workdir


def cfg_with(data, *overrides):
    return apply_overrides(load_config_file(ROOT / "configs" / "tiny.py"), [*TINY, f"data.path={data}", *overrides])


def test_parse_spec():
    assert init_from.parse("runs/a") == (init_from.Path("runs/a"), None)
    assert init_from.parse("runs/a:12") == (init_from.Path("runs/a"), 12)
    with pytest.raises(ConfigError, match="checkpoint step"):
        init_from.parse("runs/a:latest")


def test_initial_state_holds_exactly_the_source_parameters(source_run, data_dir):
    cfg = cfg_with(data_dir, f"init_from={source_run}:3", "seq_len=64", "model.rope_theta=40000.0", "steps=4")
    source = init_from.locate(cfg)
    assert source.step == 3
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = build(cfg, mesh)
    state, notes = init_from.initial_state(trainer.init(), source, mesh)
    ckpt = Checkpointer(source_run, source.cfg.checkpoint)
    expected = ckpt.restore_params(3, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state["params"]))
    ckpt.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state["params"], expected)
    # the optimizer starts afresh: zero moments, step 0
    assert int(state["step"]) == 0
    assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(state["opt_state"]) if np.asarray(x).dtype.kind == "f")
    assert notes == []
    assert "seq_len: 32 -> 64" in init_from.check_compatible(source.cfg, cfg, "src")


def test_continued_run_starts_where_the_source_ended(tmp_path, source_run, data_dir, capsys):
    rc, out = train_main(capsys, tmp_path / "fresh", data_dir, "steps=2", "seq_len=64")
    assert rc == 0, out
    rc, out = train_main(capsys, tmp_path / "continued", data_dir, "steps=2", "seq_len=64", f"init_from={source_run}")
    assert rc == 0, out
    assert f"initialised from {source_run} step 6" in out and "changed: seq_len: 32 -> 64" in out
    fresh = read_metrics(tmp_path / "fresh")[0]["loss"]
    continued = read_metrics(tmp_path / "continued")[0]["loss"]
    source_last = read_metrics(source_run)[-1]["loss"]
    # a fresh tiny model starts near ln(vocab) = 5.95; the continued one near where the source ended
    assert continued < fresh - 0.3 and abs(continued - source_last) < 0.5, (fresh, continued, source_last)
    # on resume the run's own checkpoint is used, not the source again
    rc, out = train_main(capsys, tmp_path / "continued", data_dir, "steps=3", "seq_len=64", f"init_from={source_run}")
    assert rc == 0 and "initialised from" not in out, out


def test_learned_alpha_starts_from_its_schedule(tmp_path, source_run, data_dir, capsys):
    rc, out = train_main(
        capsys,
        tmp_path / "learned",
        data_dir,
        "steps=1",
        f"init_from={source_run}",
        "model.attention.kind=offset",
        "model.attention.window=4",
        "model.attention.alpha=learned",
    )
    assert rc == 0, out
    assert "alpha_logit (new: initial value)" in out


@pytest.mark.parametrize("override, fragment", [("model.d_model=48", "model.d_model: 32 in"), ("model.num_layers=3", "model.num_layers: 2 in")])
def test_shape_changes_are_refused_before_anything_is_written(tmp_path, source_run, data_dir, capsys, override, fragment):
    rc, out = train_main(capsys, tmp_path / "new", data_dir, "steps=2", f"init_from={source_run}", override)
    assert_one_error(rc, out, "init_from", fragment)
    assert not (tmp_path / "new").exists()


def test_missing_source_or_step(tmp_path, source_run, data_dir, capsys):
    rc, out = train_main(capsys, tmp_path / "a", data_dir, f"init_from={tmp_path / 'nowhere'}")
    assert_one_error(rc, out, "not a run directory")
    rc, out = train_main(capsys, tmp_path / "b", data_dir, f"init_from={source_run}:5")
    assert_one_error(rc, out, "no checkpoint of step 5", "[3, 6]")
    with pytest.raises(CheckpointError):
        init_from.locate(cfg_with(data_dir, f"init_from={source_run}:4"))


def test_eval_rope_overrides(source_run, capsys):
    from launch.eval import main

    def nll(*args):
        assert main(["--workdir", str(source_run), "--lengths", "32,64", "--max-tokens", "2048", *args]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        path = out.strip().splitlines()[-1].removeprefix("written: ")
        report = json.loads(open(path).read())
        return path, report, [r["nll"] for rows in report["datasets"].values() for r in rows]

    _, base_report, base = nll("--tag", "base")
    path, report, identity = nll("--rope", "scaling=linear", "factor=1.0", "--tag", "identity")
    assert path.endswith("6-identity.json")
    np.testing.assert_allclose(identity, base, rtol=0, atol=1e-6)  # a factor of 1 is the identity
    path, report, scaled = nll("--rope", "scaling=linear", "factor=2.0")
    assert path.endswith("6-rope_scaling_linear-rope_factor_2.0-len_32_64-tokens_2048.json"), path
    assert report["rope"]["scaling"] == "linear" and report["rope"]["factor"] == 2.0 and base_report["rope"]["scaling"] == "none"
    assert not np.allclose(scaled, base, atol=1e-3)


def test_eval_rope_bad_key(source_run, capsys):
    from launch.eval import main

    assert main(["--workdir", str(source_run), "--rope", "base=5"]) == 2
    assert "--rope 'base=5'" in capsys.readouterr().err
