"""The extrapolation evaluator on a tiny trained run: exactness, equivalences, errors."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fibjax import data as data_lib
from fibjax.config import TrainConfig, apply_overrides
from fibjax.eval import runner
from fibjax.eval.perplexity import EvalError, scored_tokens, windows
from fibjax.run import load as run_load
from fibjax.run.workdir import CheckpointError
from fibjax.train.loop import train
from fibjax.train.step import cross_entropy
from tests.helpers import TINY


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_runs")
    data = root / "data"
    data_lib.prepare_default(data, vocab_size=384)
    out = {}
    for name, attention in (
        ("dense", ["model.attention.kind=dense"]),
        ("fib", ["model.attention.kind=offset", "model.attention.alpha=staggered", "model.attention.window=3"]),
        ("nsa", ["model.attention.kind=nsa", "model.attention.block_size=8", "model.attention.num_blocks=2", "model.attention.window=3"]),
    ):
        cfg = apply_overrides(TrainConfig(), [*TINY, "steps=3", f"data.path={data}", f"name={name}", "eval.max_tokens=1024", *attention])
        train(cfg, root / name, progress=False)
        out[name] = root / name
    return out


def test_nll_at_training_length_equals_training_loss_on_the_same_tokens(runs):
    run = run_load.load_run(runs["fib"])
    stream = data_lib.validation_tokens(run.data_dir, "python_docs")
    report = runner.evaluate_run(run, lengths=[32, 64, 128], datasets={"v": stream}, max_tokens=1024)
    first = report["datasets"]["v"][0]
    n = scored_tokens(len(stream), [32, 64, 128], 1024)
    tokens = jnp.asarray(windows(stream, n, 32))
    from flax import nnx

    from fibjax.model import Transformer

    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(run.cfg.model, rngs=nnx.Rngs(0)))), run.params)
    loss = float(cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]))
    assert first["tokens"] == n and all(r["tokens"] == n for r in report["datasets"]["v"])
    np.testing.assert_allclose(first["nll"], loss, rtol=1e-5)
    for r in report["datasets"]["v"]:  # equal bins: their mean is the total
        np.testing.assert_allclose(np.mean(r["bin_nll"]), r["nll"], rtol=1e-5)


def test_dense_weights_under_a_window_covering_everything_give_the_same_perplexity(runs):
    run = run_load.load_run(runs["dense"])
    streams = runner.dataset_streams(run, None)
    dense = runner.evaluate_run(run, lengths=[32, 128], datasets=streams, max_tokens=512)
    from fibjax.config import AttentionConfig

    wide = runner.evaluate_run(run, lengths=[32, 128], datasets=streams, max_tokens=512, attention=AttentionConfig(kind="offset", window=127))
    for a, b in zip(dense["datasets"]["python_docs"], wide["datasets"]["python_docs"]):
        np.testing.assert_allclose(a["ppl"], b["ppl"], rtol=1e-5)
    assert wide["attention_override"] and wide["attention"]["kind"] == "offset"


def test_new_distances_count_what_training_never_attended():
    from fibjax.config import AttentionConfig

    fib = AttentionConfig(kind="offset", window=8, max_rung=255)
    # bounded Fibonacci at alpha <= 1 meets no new distance at 2x or 4x
    assert runner.new_distances(fib, [0.5, 1.0], 256, 1024) == [0, 0]
    # unbounded, alpha 1 adds rungs 377, 610, 987 at 4x; alpha 1.5 (staggered top layer) adds round(1.5*233)=350 at 2x
    assert runner.new_distances(AttentionConfig(kind="offset", window=8), [1.0], 256, 1024) == [3]
    assert runner.new_distances(fib, [1.5], 256, 512) == [1]
    # pow2 is reach-matched at the evaluated length: 256 and 512 are new at 4x
    assert runner.new_distances(AttentionConfig(kind="offset", window=8, base="pow2"), [1.0], 256, 1024) == [2]
    # dense reaches every distance: 256..1023 are new
    assert runner.new_distances(AttentionConfig(kind="dense"), [None], 256, 1024) == [768]
    # learned: {lo, lo+1} of each active rung; alpha 1.1 on rung 233 -> 256.3: lo=256 is new at 2x, so is 257
    learned = AttentionConfig(kind="offset", window=8, alpha="learned", max_rung=255)
    assert runner.new_distances(learned, [1.1], 256, 512) == [2]
    assert runner.new_distances(learned, [1.0], 256, 1024) == [0]


def test_a_learned_run_evaluates_frozen_with_the_numbers_of_its_traced_alphas(runs):
    """Evaluation compiles a learned run's final alphas as constants; the NLL is the traced path's."""
    from fibjax.config import AttentionConfig
    from fibjax.eval.perplexity import evaluate_lengths

    run = run_load.load_run(runs["fib"])
    learned = AttentionConfig(kind="offset", window=3, alpha="staggered", learn_alpha=True)
    params, cfg = run_load.with_attention(run, learned)
    stream = runner.dataset_streams(run, None)["python_docs"]
    traced = evaluate_lengths(cfg, params, stream, [32, 64], max_tokens=1024, rows_tokens=128)
    frozen_params, frozen_cfg = runner.frozen_alphas(params, cfg)
    assert frozen_cfg.attention.interpolate and not frozen_cfg.attention.is_learned and "alpha_logit" not in frozen_params["blocks"][0]["attn"]
    frozen = evaluate_lengths(frozen_cfg, frozen_params, stream, [32, 64], max_tokens=1024, rows_tokens=128)
    for a, b in zip(traced, frozen):
        np.testing.assert_allclose(b.nll, a.nll, rtol=1e-5)
    report = runner.evaluate_run(run, lengths=[32, 64], datasets={"docs": stream}, max_tokens=1024, attention=learned)
    assert report["attention"]["learn_alpha"] and report["alpha_init"] is not None  # the report describes the learned run
    np.testing.assert_allclose([r["nll"] for r in report["datasets"]["docs"]], [a.nll for a in traced], rtol=1e-5)


def test_an_eight_device_mesh_gives_the_nll_of_one_device(runs):
    """Evaluation data-parallel over windows on 8 simulated devices (4 data x 2 fsdp) = 1 device."""
    from fibjax.config import MeshConfig
    from fibjax.eval.perplexity import evaluate_lengths
    from fibjax.sharding import make_mesh

    run = run_load.load_run(runs["fib"])
    stream = runner.dataset_streams(run, None)["python_docs"]
    one = evaluate_lengths(run.cfg.model, run.params, stream, [32, 64], max_tokens=1024, rows_tokens=96)
    mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1), jax.devices()[:8])
    eight = evaluate_lengths(run.cfg.model, run.params, stream, [32, 64], max_tokens=1024, rows_tokens=96, mesh=mesh)
    for a, b in zip(one, eight):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(b.nll, a.nll, rtol=1e-6)
        np.testing.assert_allclose(b.bin_nll, a.bin_nll, rtol=1e-6)
    # --dropped-mass's two measures too, a dense run under MoBA blocks
    from fibjax.config import AttentionConfig
    from fibjax.eval.error_law import error_law
    from fibjax.eval.perplexity import dropped_mass_by_layer

    dense = run_load.load_run(runs["dense"])
    params, model_cfg = run_load.with_attention(dense, AttentionConfig(kind="block_sparse", block_size=8, num_blocks=2))
    common = (model_cfg, params, stream, 64)
    kw = dict(max_tokens=1024, rows_tokens=96)
    np.testing.assert_allclose(dropped_mass_by_layer(*common, **kw, mesh=mesh), dropped_mass_by_layer(*common, **kw), rtol=1e-5, atol=1e-7)
    laws = [error_law(*common, **kw, mesh=m) for m in (mesh, None)]
    assert [x["queries"] for x in laws[0]] == [x["queries"] for x in laws[1]]
    np.testing.assert_allclose([x["slope"] for x in laws[0]], [x["slope"] for x in laws[1]], rtol=1e-5)


def test_a_run_evaluates_on_at_most_the_devices_it_took():
    """mesh.devices=N: evaluation on at most N of this machine's devices (all 8 when 0; a run
    that took more than this machine has evaluates on what it has)."""
    from fibjax.config import MeshConfig

    assert runner.eval_mesh(TrainConfig(mesh=MeshConfig(devices=1))) is None
    assert runner.eval_mesh(TrainConfig(mesh=MeshConfig(devices=4))).devices.size == 4
    assert runner.eval_mesh(TrainConfig(mesh=MeshConfig(devices=16))).devices.size == 8
    assert runner.eval_mesh(TrainConfig()).devices.size == 8


def test_report_is_written_with_alphas(runs):
    report, path = runner.evaluate_workdir(runs["fib"])
    saved = json.loads(path.read_text())
    assert path.name == f"{report['step']}.json" and saved["lengths"] == [32, 64, 128]
    assert saved["alphas"] == [0.5, 1.5]
    assert set(saved["new_distances"]) == {"32", "64", "128"} and saved["new_distances"]["32"] == [0, 0]
    assert "never attended in training" in runner.format_table(saved)
    assert "python_docs" in runner.format_table(saved)


def test_errors(runs, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):  # a run-directory error (EvalError before fibjax.run)
        run_load.load_run(runs["fib"], 7)
    run = run_load.load_run(runs["fib"])
    with pytest.raises(EvalError, match="too short"):
        runner.evaluate_run(run, lengths=[32, 4096], datasets={"v": np.zeros(1000, np.int32)}, max_tokens=10**6)
    other = tmp_path / "other_tok"
    data_lib.prepare_default(other, vocab_size=400)
    with pytest.raises(data_lib.DataError, match="tokenizer mismatch"):
        runner.dataset_streams(run, {"x": str(other)})
    # a checkpoint from another config: weights of d_model 32 under a config saying 64
    clone = tmp_path / "clone"
    shutil.copytree(runs["fib"], clone)
    cfg = json.loads((clone / "config.json").read_text())
    cfg["model"]["d_model"] = 64
    (clone / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"was saved with another model .* model.d_model: 32 \(saved with the checkpoint\) vs 64"):
        run_load.load_run(clone)
    assert jax.devices()  # the failed restore leaves JAX usable


def test_inference_mode_budget_and_dropped_mass_through_the_cli(runs, capsys):
    from launch.eval import main

    assert (
        main(["--workdir", str(runs["dense"]), "--lengths", "32,64", "--inference-mode", "sparse", "--num-blocks", "2", "--block-size", "8", "--dropped-mass"])
        == 0
    )
    out = capsys.readouterr().out
    path = runs["dense"] / "eval" / next(p.name for p in (runs["dense"] / "eval").iterdir() if "kind_block_sparse" in p.name)
    report = json.loads(path.read_text())
    assert report["attention"]["kind"] == "block_sparse" and report["attention"]["num_blocks"] == 2 and report["attention"]["block_size"] == 8
    assert report["devices"] == 1  # the run took one device (TINY's mesh.devices=1)
    masses = report["dropped_mass"]["python_docs"]
    assert all(0 < m < 1 for per_layer in masses.values() for m in per_layer)  # 2 blocks of 8 cannot hold all of 32+ keys
    assert "dropped mass" in out
    # paper B's law on every layer: errors within the bound 2 m max||v||, growing with the mass
    laws = report["error_law"]["python_docs"]
    stats = [(x["bound_violations"], x["slope"], x["max_error_over_bound"]) for layers in laws.values() for x in layers]
    assert all(v == 0 and slope > 0 and 0 < ratio <= 1.001 for v, slope, ratio in stats), stats
    assert "error law, python_docs @ 32" in out
    assert main(["--workdir", str(runs["dense"]), "--lengths", "32", "--inference-mode", "full", "--dropped-mass"]) == 0
    full = json.loads(next(p for p in (runs["dense"] / "eval").iterdir() if "kind_dense" in p.name).read_text())
    assert all(m == 0 for per_layer in full["dropped_mass"]["python_docs"].values() for m in per_layer)
    assert all(x["mean_error"] == 0 for layers in full["error_law"]["python_docs"].values() for x in layers)
    with pytest.raises(SystemExit) as exit_:
        main(["--workdir", str(runs["dense"]), "--inference-mode", "sparse", "--num-blocks", "0"])
    assert exit_.value.code == 2 and "--num-blocks: must be >= 1" in capsys.readouterr().err


def test_dropped_mass_of_nsa_is_its_selected_blocks_and_no_error_law_is_fitted(runs, capsys):
    """NSA's output mixes three gated branches, so the error law's bound (one softmax over a subset
    of the causal keys) does not hold for it: --dropped-mass reports the selected branch's mass
    and says why there is no law, instead of fitting one that means nothing."""
    from fibjax.eval import report as rep
    from launch.eval import main

    assert main(["--workdir", str(runs["nsa"]), "--lengths", "32,64", "--dropped-mass"]) == 0
    out = capsys.readouterr().out
    path = next(p for p in (runs["nsa"] / "eval").iterdir() if "dropped_mass" in p.name)
    report = json.loads(path.read_text())
    masses = [m for per_layer in report["dropped_mass"]["python_docs"].values() for m in per_layer]
    assert len(masses) == 2 * 2 and all(0 < m < 1 for m in masses)  # 2 blocks of 8 cannot hold 32+ keys
    assert "error_law" not in report and "selected blocks" in report["error_law_skipped"]
    assert "error law: not fitted: nsa's output is not one softmax" in out and "dropped mass vs dense, python_docs @ 32" in out
    table = rep.error_law_table(rep.load_runs([path])[0])
    assert table.rows[0][3:] == [f"{np.mean(report['dropped_mass']['python_docs']['32']):.4f}", "—", "—", "—", "—"]
    assert table.notes[-1] == f"— : no law fitted for {table.rows[0][0]}: {report['error_law_skipped']}."


def test_an_nsa_model_evaluates_under_full_and_block_sparse_attention(runs, capsys):
    """NSA's layers hold gates and a compression that dense and MoBA layers do not: evaluating an
    NSA model under --inference-mode full (paper B's comparison) failed with "Incorrect number of
    leaves" until the override carried them (nsa_params, unused)."""
    from launch.eval import main

    assert main(["--workdir", str(runs["nsa"]), "--lengths", "32,64", "--inference-mode", "full"]) == 0
    assert main(["--workdir", str(runs["nsa"]), "--lengths", "32", "--attention", "kind=block_sparse", "num_blocks=2", "block_size=8"]) == 0
    capsys.readouterr()
    reports = {json.loads(p.read_text())["attention"]["kind"]: json.loads(p.read_text()) for p in (runs["nsa"] / "eval").glob("*kind_*.json")}
    assert {"dense", "block_sparse"} <= set(reports)
    for report in (reports["dense"], reports["block_sparse"]):
        assert report["attention"]["nsa_params"] and all(math.isfinite(r["nll"]) for r in report["datasets"]["python_docs"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "0"], "every length must be >= 8"),
        (["--lengths", "-5"], "every length must be >= 8"),
        (["--lengths", "256,0"], "every length must be >= 8"),
        (["--lengths", "4"], "every length must be >= 8"),
        (["--lengths", "1x"], "comma-separated integers"),
        (["--max-tokens", "-5"], "--max-tokens: must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
        (["--step", "0"], "--step: must be >= 1"),
    ],
)
def test_cli_arguments_are_validated_with_one_error_line(args, message, capsys):
    from launch.eval import main

    with pytest.raises(SystemExit) as exit_:
        main(["--workdir", "unused", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


def test_a_block_budget_on_a_run_without_block_sparse_attention_is_an_error(runs, capsys):
    from launch.eval import main

    before = sorted((runs["fib"] / "eval").glob("*.json")) if (runs["fib"] / "eval").exists() else []
    assert main(["--workdir", str(runs["fib"]), "--num-blocks", "2"]) == 2
    assert "block-sparse budget" in capsys.readouterr().err
    after = sorted((runs["fib"] / "eval").glob("*.json")) if (runs["fib"] / "eval").exists() else []
    assert after == before  # nothing written under a name that claims a budget


def test_dropped_mass_or_a_token_cap_never_replaces_the_end_of_training_report(runs):
    """At the default lengths, --dropped-mass and --max-tokens wrote eval/<step>.json over the
    end-of-training report; each setting now has its own file."""
    from launch.eval import main

    run = runs["fib"]
    assert main(["--workdir", str(run)]) == 0  # the report of the run's own settings
    base = next(p for p in (run / "eval").iterdir() if p.name.split(".")[0].isdigit())
    before = base.read_text()
    assert main(["--workdir", str(run), "--max-tokens", "512"]) == 0
    assert main(["--workdir", str(run), "--dropped-mass", "--max-tokens", "512"]) == 0
    assert base.read_text() == before
    names = {p.name for p in (run / "eval").iterdir()}
    assert {f"{base.stem}-tokens_512.json", f"{base.stem}-tokens_512-dropped_mass.json"} <= names
