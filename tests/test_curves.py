"""The validation curve beyond the training length (``eval.curve_multipliers``): each point is
the model's mean NLL on fixed windows of m x seq_len tokens, equal to the same NLL computed
directly from the checkpoint of that step."""

import numpy as np
import pytest

from fibjax import data as data_lib
from fibjax.config import ConfigError, EvalConfig
from fibjax.train.metrics import read_metrics
from tests.helpers import train_main


def direct_nll(workdir, tokens_NT1) -> float:
    from flax import nnx

    from fibjax.model import Transformer
    from fibjax.run import load as run_load
    from fibjax.train.step import cross_entropy

    run = run_load.load_run(workdir)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(run.cfg.model, rngs=nnx.Rngs(0)))), run.params)
    return float(cross_entropy(model(tokens_NT1[:, :-1]), tokens_NT1[:, 1:]))


def test_the_4x_curve_is_the_nll_of_4x_windows_at_that_step(tmp_path, data_dir, capsys):
    # seq_len 32: 4x windows of 129 tokens, 384 long-curve tokens = 3 windows in one batch of 3 rows
    rc, out = train_main(capsys, tmp_path / "run", data_dir, "steps=4", "eval.every_steps=2", "eval.curve_multipliers=1,4", "eval.curve_long_tokens=384")
    assert rc == 0, out
    points = [r for r in read_metrics(tmp_path / "run") if "val_4x/python_docs" in r]
    assert [r["step"] for r in points] == [2, 4] and all("val/python_docs" in r for r in points)
    assert [r["tokens"] for r in points] == [2 * 8 * 32, 4 * 8 * 32]  # tokens seen: 8 x 32 a step
    stream = data_lib.validation_tokens(data_dir, "python_docs")
    tokens = np.asarray(stream[: 3 * 129], dtype=np.int32).reshape(3, 129)
    np.testing.assert_allclose(points[-1]["val_4x/python_docs"], direct_nll(tmp_path / "run", tokens), rtol=1e-5)
    assert points[0]["val_4x/python_docs"] != points[1]["val_4x/python_docs"]  # scored with each step's parameters


@pytest.mark.parametrize("curve", [(4,), (1, 4, 4), (1, 0)])
def test_curve_multipliers_must_include_1_and_be_distinct_positive(curve):
    with pytest.raises(ConfigError, match="curve_multipliers"):
        EvalConfig(curve_multipliers=curve)


def test_the_long_curve_plot_shows_the_perplexity_change_against_tokens(tmp_path):
    from types import SimpleNamespace

    from fibjax.eval import plots

    metrics = [
        {"step": 10, "loss": 5.0},
        {"step": 10, "tokens": 1000, "val/a": 5.0, "val/b": 4.0, "val_4x/a": 5.2, "val_4x/b": 4.0},
        {"step": 20, "tokens": 2000, "val/a": 4.5, "val/b": 3.5, "val_4x/a": 4.5, "val_4x/b": 3.3},
    ]
    run = SimpleNamespace(label="r", workdir=tmp_path, metrics=metrics)
    tokens, change = plots._long_curve(run, 4)
    np.testing.assert_array_equal(tokens, [1000, 2000])
    np.testing.assert_allclose(change, [100 * np.expm1(0.1), 100 * np.expm1(-0.1)])  # the mean NLL gap over a and b
    assert plots.plot_long_curves([run], tmp_path / "long.png") and (tmp_path / "long.png").stat().st_size > 0
    no_curve = SimpleNamespace(label="r", workdir=tmp_path, metrics=metrics[:1])
    assert not plots.plot_long_curves([no_curve], tmp_path / "none.png")


def test_curve_keys_round_trip_and_other_keys_are_not_curves():
    from fibjax.run.curves import curve_key, curve_values, multipliers, parse_curve_key

    for m, source in [(1, "fineweb"), (4, "fineweb"), (16, "fineweb_edu")]:
        assert parse_curve_key(curve_key(m, source)) == (m, source)
    assert curve_key(1, "a") == "val/a" and curve_key(4, "a") == "val_4x/a"  # the metrics.jsonl format
    for other in ("loss", "val", "val/", "val_x/a", "val_4/a", "valid/a", "val_4x"):
        assert parse_curve_key(other) is None, other
    row = {"step": 3, "loss": 2.0, "val/a": 4.0, "val/b": 5.0, "val_4x/a": 4.5}
    assert curve_values(row) == {"a": 4.0, "b": 5.0} and curve_values(row, 4) == {"a": 4.5}
    assert multipliers([row, {"val_2x/b": 1.0}]) == [2, 4]
