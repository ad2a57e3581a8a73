"""The retrieval probe: task generators, scoring, band geometry, the weighted loss, one real
learning cell (the smoke cell), the resumable grid, the report and the CLI."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibjax import sharding
from fibjax.attention import offsets
from fibjax.config import AttentionConfig
from fibjax.probe import geometry, grid, report, soft_width
from fibjax.probe.cell import CellSpec, run_cell
from fibjax.probe.tasks import Band, DistanceSampler, Vocab, bigram_starts, forced_choice_correct, marked_batch, marked_correct, retrieval_batch
from fibjax.train import step
from launch import probe as probe_cli
from tests.helpers import inside_the_figure
from tests.tiers import slow

VOCAB = Vocab(filler=40, keys=12, values=12)


@st.composite
def retrieval_cases(draw):
    t = draw(st.integers(4, 96))
    d = draw(st.integers(1, t - 2))
    room = (t - 2 - d) // 2 + (d - 1) // 2  # bigrams that fit before and after the target
    n = draw(st.integers(0, min(room, 8)))
    return t, d, n, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=150, deadline=None)
@given(retrieval_cases())
def test_retrieval_places_the_target_at_exactly_d_with_the_right_tokens(case):
    t, d, n, seed = case
    b = retrieval_batch(np.random.default_rng(seed), 3, t, d, n, VOCAB)
    keys, values = set(VOCAB.key_ids), set(VOCAB.value_ids)
    assert b.inputs.shape == (3, t) and b.inputs.dtype == np.int32 and b.choices.shape == (3, 1 + n)
    for x, target, choices in zip(b.inputs, b.target, b.choices):
        kstar = x[-1]
        assert kstar in keys and x[t - 1 - d] == target == choices[0] and x[t - 2 - d] == kstar
        assert len(set(choices)) == 1 + n and set(choices) <= values
        key_at = [i for i in range(t) if x[i] in keys]
        value_at = [i for i in range(t) if x[i] in values]
        assert len(key_at) == 2 + n and len(value_at) == 1 + n  # K* twice, n distractor keys
        assert [i + 1 for i in key_at[:-1]] == value_at  # every key but the query is followed by its value
        assert sorted(x[value_at]) == sorted(choices)
        assert [i for i in key_at if x[i] == kstar] == [t - 2 - d, t - 1]  # only the target matches the query
        assert all(x[i] < VOCAB.filler for i in set(range(t)) - set(key_at) - set(value_at))


def test_retrieval_rejects_what_does_not_fit():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="does not fit"):
        retrieval_batch(rng, 1, 16, 15, 0, VOCAB)
    with pytest.raises(ValueError, match="distractor"):
        retrieval_batch(rng, 1, 16, 5, 7, VOCAB)  # 9 free cells before the target and 4 after it hold 4 + 2 bigrams
    assert retrieval_batch(rng, 1, 16, 5, 6, VOCAB).choices.shape == (1, 7)
    with pytest.raises(ValueError, match="distinct keys"):
        retrieval_batch(rng, 1, 64, 5, 12, VOCAB)


def test_bigram_placements_are_uniform():
    """2 bigrams in segments of 4 and 3 cells: C(4-2,2)*1 + C(3,1)*C(2,1) + 1*0 = 1 + 6 = 7 placements."""
    rng = np.random.default_rng(0)
    seen = {}
    for _ in range(7000):
        key = tuple(sorted(bigram_starts(rng, ((0, 4), (5, 8)), 2)))
        seen[key] = seen.get(key, 0) + 1
    assert sorted(seen) == [(0, 2), (0, 5), (0, 6), (1, 5), (1, 6), (2, 5), (2, 6)]
    assert min(seen.values()) > 850 and max(seen.values()) < 1150


def test_marked_targets_copy_from_the_marked_distance():
    b = marked_batch(np.random.default_rng(1), 4, 40, (7, 19), 16)
    assert b.inputs.max() < 32 and set(np.unique(b.marker)) == {0, 1}
    for row in range(4):
        for t in range(40):
            d = (7, 19)[b.marker[row, t]]
            assert b.inputs[row, t] // 16 == b.marker[row, t]
            assert b.valid[row, t] == (t >= d)
            if t >= d:
                assert b.targets[row, t] == b.inputs[row, t - d]
    perfect = marked_correct(b.targets, b)
    assert all(hit == n > 0 for hit, n in perfect.values())
    assert set(perfect) == {7, 19} and sum(n for _, n in perfect.values()) == b.valid.sum()


def test_forced_choice_oracle_is_one_and_uniform_is_chance():
    rng = np.random.default_rng(0)
    b = retrieval_batch(rng, 64, 48, 20, 4, VOCAB)
    oracle = np.zeros((64, VOCAB.size))
    oracle[np.arange(64), b.target] = 5.0
    oracle[:, VOCAB.filler] = 50.0  # a non-value id scoring higher is not a choice: ignored
    assert forced_choice_correct(oracle, b.choices, b.target).mean() == 1.0
    assert forced_choice_correct(np.zeros((64, VOCAB.size)), b.choices, b.target).mean() == pytest.approx(1 / 5)
    wrong = np.zeros((64, VOCAB.size))
    wrong[np.arange(64), b.choices[:, 1]] = 1.0
    assert forced_choice_correct(wrong, b.choices, b.target).mean() == 0.0
    tie = np.zeros((64, VOCAB.size))
    tie[np.arange(64), b.choices[:, 0]] = tie[np.arange(64), b.choices[:, 1]] = 1.0
    assert forced_choice_correct(tie, b.choices, b.target).mean() == 0.5


def test_distance_samplers():
    rng = np.random.default_rng(0)
    band = DistanceSampler((Band.around(44, 4),))
    assert band.support() == [42, 43, 44, 45, 46] and {band.draw(rng) for _ in range(300)} == set(band.support())
    multi = DistanceSampler((Band(3, 3), Band(10, 12)))
    draws = [multi.draw(rng) for _ in range(2000)]
    assert set(draws) == {3, 10, 11, 12} and 0.45 < draws.count(3) / 2000 < 0.55  # a band first, then a distance
    with pytest.raises(ValueError):
        DistanceSampler((Band(0, 3),))


@pytest.mark.parametrize("seq_len, width", [(64, 4), (128, 4), (256, 8)])
def test_band_candidates_are_uncovered_at_one_and_reachable(seq_len, width):
    w = 8
    at_one = set(offsets.attended_distances(window=w, base="fibonacci", alpha=1.0, seq_len=seq_len))
    cands = geometry.band_candidates(window=w, base="fibonacci", seq_len=seq_len, width=width, max_distance=seq_len - 2)
    assert cands
    for c in cands:
        assert not at_one & set(Band.around(c, width).distances())
        for f, lo, hi in geometry.alphas_for(c, window=w, base="fibonacci", seq_len=seq_len):
            mid = (lo + hi) / 2
            assert round(mid * f) == c and c in offsets.attended_distances(window=w, base="fibonacci", alpha=mid, seq_len=seq_len)
        assert geometry.alphas_for(c, window=w, base="fibonacci", seq_len=seq_len)
    # a distance a rung covers at alpha = 1 is never a candidate
    assert not at_one & set(cands)


def test_grid_defaults_come_from_the_geometry():
    opts = grid.GridOptions()
    (band,) = grid.band_centres(opts, "band")
    assert band == 44 and grid.marked_pair(opts) == (27, 44)
    rows = geometry.distance_table(Band.around(44, 4), AttentionConfig(kind="offset", window=8), 2, 64)
    assert [r["nearest_distance"] for r in rows] == [34, 34] and not any(r["covers_band"] for r in rows)
    assert rows[0]["alpha_for_centre"] == pytest.approx(44 / 55)
    stagger = geometry.distance_table(Band.around(44, 4), AttentionConfig(kind="offset", window=8, alpha="staggered"), 2, 64)
    assert stagger[0]["covers_band"]  # alpha 0.5: round(0.5 * 89) = 44
    assert "44" in grid.plan(opts)


def test_weighted_loss_reads_only_the_weighted_positions():
    spec = CellSpec(
        experiment="t",
        task="retrieval",
        condition="fib_learned",
        depth=2,
        bands=((3, 5),),
        seq_len=16,
        d_model=32,
        num_heads=2,
        num_kv_heads=1,
        batch=4,
        steps=3,
    )
    cfg = spec.train_config()
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = step.build(cfg, mesh)
    batch = spec.train_batch(0)
    with jax.set_mesh(mesh):
        state = trainer.init()
        model = jax.jit(lambda p, x: __import__("flax").nnx.merge(trainer.graphdef, p)(x))
        logits = np.asarray(model(state["params"], batch["inputs"]))
        manual = -jax.nn.log_softmax(logits[:, -1])[np.arange(4), batch["targets"][:, -1]].mean()
        new_state, metrics = trainer.step(state, jax.device_put(batch, trainer.batch_sharding))
    np.testing.assert_allclose(float(metrics["loss"]), manual, rtol=1e-5)
    assert set(metrics["alphas"]) == {"layer_0", "layer_1"}
    tokens = np.concatenate([batch["inputs"], batch["inputs"][:, :1]], axis=1)  # the language-model batch still works
    full = step.cross_entropy(logits, tokens[:, 1:])
    assert np.isclose(float(full), float(step.cross_entropy(logits, tokens[:, 1:], np.ones((4, 16)))))


@pytest.fixture(scope="module")
def smoke_cell(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    spec = grid.smoke_spec()
    record = run_cell(spec, log=lambda _: None)
    grid.write_json(grid.cell_path(out, spec), record)
    return out, record


def test_a_dense_model_learns_retrieval_in_the_smoke_cell(smoke_cell):
    _, record = smoke_cell
    acc = record["accuracy"]
    assert acc["chance"] == pytest.approx(0.2) and acc["distances"] == [2, 4, 6, 8]
    # well above chance (0.2; 128 sequences per distance, so chance's standard error is 0.035): the probe shows learning where it exists
    assert np.mean(acc["accuracy"]) > 0.45 and min(acc["accuracy"]) > 0.3, acc
    assert record["loss_trajectory"]["loss"][-1] < record["loss_trajectory"]["loss"][0] / 2
    assert record["alpha_init"] == record["alpha_final"] == [] and not record["learned"]


@slow
def test_grid_skips_done_cells_and_the_report_covers_learned_and_marked(smoke_cell, tmp_path, monkeypatch):
    out, _ = smoke_cell
    opts = grid.GridOptions(
        experiments=("band", "marked"),
        conditions=("fib_learned_stagger",),
        depths=(2,),
        seq_len=32,
        band_centres=(15,),
        marked_distances=(10, 15),
        steps=4,
        batch=4,
    )
    calls = []
    real = run_cell
    monkeypatch.setattr(grid, "run_cell", lambda spec, log: calls.append(spec.name) or real(spec, log))
    grid.run_grid(opts, out, log=lambda _: None)
    assert calls == ["fib_learned_stagger_L2"] * 2
    grid.run_grid(opts, out, log=lambda _: None)
    assert len(calls) == 2  # every cell's JSON exists: nothing runs again
    cell = json.loads((out / "band" / "fib_learned_stagger_L2.json").read_text())
    assert cell["alpha_init"] == pytest.approx([0.55, 1.45]) and len(cell["alpha_trajectory"]["steps"]) == 2  # step 0 and the end
    assert cell["geometry"]["init"]["bands"][0]["band"] == [13, 17]
    tables, written, markdown = report.build_report(out)
    names = {t.name for t in tables}
    assert {"accuracy_band", "accuracy_smoke", "marked", "alpha", "alpha_summary"} <= names
    assert {"alpha_band.png", "alpha_marked.png", "accuracy_band.png", "marked.png", "report.md"} <= {p.name for p in written}
    alpha_rows = next(t for t in tables if t.name == "alpha").csv_rows
    assert len(alpha_rows) == 2 + 2 * 2  # band: 2 layers; marked: 2 layers x 2 distances
    assert "Did alpha move?" in markdown and "![" in markdown and "distance 15 is put on a rung by f = 13" in markdown


def test_cli_plan_and_report_only(smoke_cell, capsys):
    out, _ = smoke_cell
    assert probe_cli.main(["--plan"]) == 0
    assert "band: distance 44" in capsys.readouterr().out
    assert probe_cli.main(["--report-only", "--out", str(out), "--no-plots"]) == 0
    assert (out / "report.md").exists()
    assert probe_cli.main(["--experiments", "nope", "--plan"]) == 2


def test_soft_width_gives_alpha_a_non_local_gradient_and_anneals_to_the_hard_set():
    def pull(width):  # d/d alpha of the bias at distance 44, ten positions from the rung 34 at alpha = 1
        return float(jax.grad(lambda a: soft_width.distance_bias(64, window=8, rungs=(34,), alpha=a, width=width)[63, 63 - 44])(1.0))

    assert pull(8.0) > 1.0 and abs(pull(0.5)) < 1e-30  # the interpolated path's gradient here is 0 too
    bias = np.asarray(soft_width.distance_bias(16, window=3, rungs=(5, 8, 13), alpha=1.0, width=0.05))
    hard = set(offsets.attended_distances(window=3, base=(5, 8, 13), alpha=1.0, seq_len=16))
    assert {d for d in range(16) if bias[15, 15 - d] > -1} == hard and np.isneginf(bias[3, 4])
    assert soft_width.width_at(0, 100, 8.0) == 8.0 and soft_width.width_at(80, 100, 8.0) == soft_width.width_at(99, 100, 8.0) == 0.5
    with pytest.raises(ValueError, match="learned"):
        CellSpec(experiment="soft", task="retrieval", condition="fib_fixed", depth=2, bands=((3, 5),), seq_len=16, soft_width=4.0)


def test_the_smoke_report_says_what_covers_its_band_and_describes_only_its_columns(smoke_cell, tmp_path, monkeypatch):
    """The smoke cell's band (2-8) sits in the window W = 8 and its table has no @d column."""
    import shutil

    from fibjax.eval import plots

    out, _ = smoke_cell
    shutil.copytree(out / "smoke", tmp_path / "smoke")  # the smoke cell alone (other tests add cells to ``out``)
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    tables, _, markdown = report.build_report(tmp_path)
    assert "distance 5 is inside the dense window (0-8)" in markdown and "no rung" not in markdown
    smoke = next(t for t in tables if t.name == "accuracy_smoke")
    assert not any(h.startswith("@") for h in smoke.header) and "Columns" not in smoke.notes[0]
    assert len(figures) == 2 and all(inside_the_figure(fig) == [] for fig in figures)
    assert "shaded" not in figures[0].get_suptitle()  # nothing is shaded: every read distance was trained


def test_the_column_note_names_the_columns_the_table_has():
    assert report._columns_note([], {13, 21}) == "Every distance's accuracy is in the CSV."
    both = report._columns_note([13, 15, 17, 21], {13, 21})
    assert "edges and centre of a band that leaves some read distance out (15, 17)" in both and "rungs among the read distances (13, 21)" in both
    assert "band" not in report._columns_note([13], {13, 21})
    assert report._reach_text(40, 8, 32) == "distance 40 is past the sequence (T - 1 = 31)."
    assert report._reach_text(15, 8, 32).startswith("distance 15 is put on a rung by f = 13")


def test_the_equal_cost_window_has_fib_fixed_s_keys_and_attends_a_band():
    """window_equal: as many keys per query as fib_fixed at the probe's (W, T), the last ones."""
    from fibjax.kinds import registry
    from fibjax.probe.cell import CellSpec

    for seq_len, window in ((64, 8), (128, 8), (64, 4)):
        fixed = CellSpec("band", "retrieval", "fib_fixed", 2, bands=((40, 44),), seq_len=seq_len, window=window).attention()
        equal = CellSpec("band", "retrieval", "window_equal", 2, bands=((40, 44),), seq_len=seq_len, window=window).attention()
        keys = len(registry.kind_of(fixed).attended(fixed, 1.0, seq_len))
        assert equal.kind == "window" and registry.kind_of(equal).attended(equal, None, seq_len) == tuple(range(keys))
    assert CellSpec("band", "retrieval", "window_equal", 2, bands=((40, 44),), seq_len=64).attention().window == 13  # {0..8}, 13, 21, 34, 55
