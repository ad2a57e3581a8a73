"""fibjax.eval.paired: the study's paired test across seeds, against scipy's own paired t-test."""

import math

import pytest
from scipy import stats

from fibjax.eval.paired import Comparison, PairedResult, markdown, paired, plot, write_csv

STAGGER, FIXED = "configs/cpu/fib_stagger_w8.py", "configs/cpu/fib_fixed_w8.py"


def nlls_of(values):
    """{model: {seed: {"fineweb": {256: nll}}}} from {model: [nll per seed 42..]}."""
    return {m: {42 + i: {"fineweb": {256: v}} for i, v in enumerate(vs)} for m, vs in values.items()}


def test_the_statistic_is_scipys_paired_t_test():
    a = [4.91, 4.95, 4.90, 4.99, 4.93]
    b = [4.92, 4.95, 4.93, 5.00, 4.92]
    (r,) = paired(nlls_of({STAGGER: a, FIXED: b}), [Comparison("s - f", STAGGER, FIXED)])
    ref = stats.ttest_rel(a, b)
    assert r.seeds == (42, 43, 44, 45, 46) and r.n == 5
    assert r.mean == pytest.approx(sum(x - y for x, y in zip(a, b)) / 5)
    assert r.t == pytest.approx(ref.statistic) and r.p == pytest.approx(ref.pvalue)
    lo, hi = r.ci95
    ci = ref.confidence_interval(0.95)
    assert (lo, hi) == (pytest.approx(ci.low), pytest.approx(ci.high))


def test_only_seeds_with_both_models_pair_and_one_seed_has_no_test():
    nlls = nlls_of({STAGGER: [5.0, 5.1, 5.2], FIXED: [5.1]})
    (r,) = paired(nlls, [Comparison("s - f", STAGGER, FIXED)])
    assert r.seeds == (42,) and r.diffs == (pytest.approx(-0.1),)
    assert r.se is None and r.t is None and r.p is None and r.ci95 is None
    assert "| 1 | 42: -0.1000 |" in markdown([r], 256) and "| — | — |" in markdown([r], 256)
    assert paired(nlls, [Comparison("x", STAGGER, "configs/none.py")]) == []


def test_a_length_evaluated_by_some_seeds_only_pairs_those():
    nlls = nlls_of({STAGGER: [5.0, 5.1], FIXED: [5.2, 5.2]})
    nlls[STAGGER][43]["fineweb"][4096] = 6.0
    nlls[FIXED][43]["fineweb"][4096] = 6.5
    results = {r.length: r for r in paired(nlls, [Comparison("s - f", STAGGER, FIXED)])}
    assert results[256].n == 2 and results[4096].seeds == (43,) and results[4096].mean == pytest.approx(-0.5)


def test_identical_differences_give_an_infinite_t_not_a_crash():
    r = PairedResult("c", "d", 256, (42, 43), (-0.01, -0.01))
    assert r.se == 0 and r.t == -math.inf and r.p == 0.0


def test_csv_and_figure(tmp_path):
    nlls = nlls_of({STAGGER: [4.9, 5.0, 5.1], FIXED: [5.0, 5.0, 5.2]})
    results = paired(nlls, [Comparison("s - f", STAGGER, FIXED)])
    rows = write_csv(results, tmp_path / "paired.csv").read_text().splitlines()
    assert rows[0].startswith("comparison,dataset,length,n,seeds") and rows[1].startswith("s - f,fineweb,256,3,42 43 44,")
    assert plot(results, tmp_path / "paired.png", 256).stat().st_size > 1000
    assert plot([], tmp_path / "none.png", 256) is None


def test_pairing_holds_the_cpu_studys_models_of_one_seed_start_from_the_same_weights():
    """A paired difference cancels the seed's luck only if both models start alike: at one seed
    every model the study compares (dense, fixed, stagger, static 0.99, the window of 16) draws
    the same initial weights, array for array (their attention has no weights of its own)."""
    import jax
    import numpy as np
    from flax import nnx

    from fibjax.config import apply_overrides, load_config_file
    from fibjax.model import Transformer

    configs = (STAGGER, FIXED, "configs/cpu/dense.py", "configs/cpu/window_equal_w8.py", "configs/study/fib_static099_w8.py")
    params = []
    for path in configs:
        cfg = apply_overrides(load_config_file(path), ["seed=45"])
        params.append(nnx.to_pure_dict(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param)))
    first = jax.tree.leaves(params[0])
    for path, p in zip(configs[1:], params[1:]):
        assert jax.tree.structure(p) == jax.tree.structure(params[0]), path
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p), first)), path
    other = apply_overrides(load_config_file(STAGGER), ["seed=46"])
    reseeded = jax.tree.leaves(nnx.to_pure_dict(nnx.state(Transformer(other.model, rngs=nnx.Rngs(other.seed)), nnx.Param)))
    assert not all(np.array_equal(a, b) for a, b in zip(reseeded, first))  # the check can fail: another seed, other weights
