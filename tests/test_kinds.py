"""Attention kinds are objects: a kind defined in this file alone (no library file edited) trains,
evaluates and decodes, and every built-in kind answers the protocol consistently."""

import json
import subprocess
import sys
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax import kinds
from fibjax.config import AttentionConfig, ConfigError, ModelConfig, TrainConfig, apply_overrides
from fibjax.kinds.base import ALWAYS, KV, AttentionKind, LayerPlan, as_output, own_and_cached, read, ring_rows, write_rows
from tests.helpers import ROOT, TINY


class RecentWindow(AttentionKind):
    """A toy kind: each query attends its ``window`` most recent keys, itself included
    (distances 0 .. window - 1), written with plain jnp here, nothing of fibjax.attention."""

    name = "toy_recent"
    bounded_context = False  # a ring buffer of ``window`` rows: any length decodes

    def attend(self, attn, q_BTHE, k_BTKE, v_BTKE, acfg, *, x_BTD=None, return_lse=False):
        t, h, kh = q_BTHE.shape[1], q_BTHE.shape[2], k_BTKE.shape[2]
        k_BTHE, v_BTHE = (jnp.repeat(x, h // kh, axis=2) for x in (k_BTKE, v_BTKE))
        s_BHTS = jnp.einsum("bthe,bshe->bhts", q_BTHE, k_BTHE).astype(jnp.float32) / np.sqrt(q_BTHE.shape[-1])
        d_TS = np.arange(t)[:, None] - np.arange(t)[None, :]
        s_BHTS = jnp.where((d_TS >= 0) & (d_TS < acfg.window), s_BHTS, -jnp.inf)
        p_BHTS = jnp.exp(s_BHTS - s_BHTS.max(-1, keepdims=True))
        p_BHTS = p_BHTS / p_BHTS.sum(-1, keepdims=True)
        return jnp.einsum("bhts,bshe->bthe", p_BHTS.astype(v_BTHE.dtype), v_BTHE)

    def attended(self, acfg, alpha, seq_len):
        return tuple(range(min(acfg.window, seq_len)))

    def plan(self, attn, max_len):
        return LayerPlan(self, min(attn.cfg.attention.window, max_len), max_len)

    def step(self, plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, kv, pos):
        q_BKGE, own_k, own_v = own_and_cached(q_B1HE, k_B1KE, v_B1KE, kv)
        d_S = np.arange(1, plan.rows)
        o_BKGE, _ = read(q_BKGE, [own_k, ring_rows(kv.k, pos - d_S)], [own_v, ring_rows(kv.v, pos - d_S)], [ALWAYS, pos >= d_S])
        out_B1HE = as_output(o_BKGE, q_B1HE)
        return out_B1HE, KV(*write_rows(kv, k_B1KE, v_B1KE, pos, after=out_B1HE))


@pytest.fixture
def toy():
    kind = kinds.register(RecentWindow())
    yield kind
    kinds.unregister(kind.name)


def test_a_kind_registered_in_a_test_trains_evaluates_and_decodes(toy, tmp_path):
    from fibjax.data.prepare import prepare_default
    from fibjax.decode import Decoder
    from fibjax.decode import run as run_lib
    from fibjax.eval import runner
    from fibjax.train.loop import train

    data = tmp_path / "data"
    prepare_default(data, vocab_size=384)
    cfg = apply_overrides(TrainConfig(), [*TINY, "steps=6", f"data.path={data}", "model.attention.kind=toy_recent", "model.attention.window=5"])
    result = train(cfg, tmp_path / "run", progress=False)
    assert len(result.losses) == 6 and np.isfinite(result.losses).all()

    report, path = runner.evaluate_workdir(tmp_path / "run", lengths=[32, 64], max_tokens=1024)
    assert report["attention"]["kind"] == "toy_recent" and json.loads(path.read_text())["step"] == 6
    assert report["new_distances"] == {"32": [0, 0], "64": [0, 0]}  # a fixed window meets no new distance
    assert all(np.isfinite(r["nll"]) for rows in report["datasets"].values() for r in rows)

    loaded = run_lib.load(tmp_path / "run")
    assert run_lib.context_limit(loaded.cfg) is None  # the kind says its decode is not bounded
    tokens = np.random.default_rng(0).integers(0, 384, (2, 40)).astype(np.int32)  # past the training length
    full = np.asarray(nnx.jit(lambda m, x: m(x))(loaded.model, jnp.asarray(tokens)))[:, 7:]
    decoder = Decoder(loaded.model, max_len=40)
    assert [p.rows for p in decoder.plans] == [5, 5]
    cache, logits, _ = decoder.prefill(tokens[:, :8])
    rows = [logits]
    for pos in range(8, 40):
        cache, logits, _ = decoder.step(cache, tokens[:, pos], pos)
        rows.append(logits)
    np.testing.assert_allclose(np.stack([np.asarray(r) for r in rows], 1), full, atol=1e-4, rtol=0)


def test_an_unregistered_kind_is_a_config_error_naming_the_known_ones(toy):
    assert AttentionConfig(kind="toy_recent").kind == "toy_recent"
    kinds.unregister("toy_recent")
    with pytest.raises(ConfigError, match="kind: must be a registered attention kind: dense, offset, block_sparse, nsa"):
        AttentionConfig(kind="toy_recent")
    kinds.register(toy)  # for the fixture's teardown
    with pytest.raises(ValueError, match="already registered"):
        kinds.register(RecentWindow())
    with pytest.raises(ValueError, match="built-in"):
        kinds.unregister("dense")


@dataclass(frozen=True)
class Case:
    attention: dict
    sparse: bool
    has_alpha: bool
    variant: str  # the kind that runs it


CASES = {
    "dense": Case(dict(kind="dense"), False, False, "dense"),
    "offset": Case(dict(kind="offset", alpha="staggered"), True, True, "offset"),
    "learned": Case(dict(kind="offset", alpha="learned"), True, True, "interpolated"),
    "frozen": Case(dict(kind="offset", alpha="staggered", interpolate=True), True, True, "interpolated"),
    "block_sparse": Case(dict(kind="block_sparse"), True, False, "block_sparse"),
    "nsa": Case(dict(kind="nsa"), True, False, "nsa"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_built_in_kinds_answer_the_protocol(name):
    case = CASES[name]
    acfg = AttentionConfig(**case.attention)
    kind = kinds.kind_of(acfg)
    assert kind.name == case.variant and kinds.get(acfg.kind).sparse == case.sparse and acfg.has_alpha == case.has_alpha
    alpha = 1.0 if acfg.has_alpha else None
    attended = kind.attended(acfg, alpha, 256)
    reachable = kind.reachable(acfg, alpha, 256)
    if attended is not None:  # a fixed set is among what the layer can reach, and the window is in it
        assert set(attended) <= reachable | {d + 1 for d in reachable} and 0 in attended
    assert reachable <= set(range(256)) and kind.reachable(acfg, alpha, 256) <= kind.reachable(acfg, alpha, 1024)
    assert kind.label(acfg)


def test_only_the_registry_compares_kind_names():
    """No module outside fibjax/kinds compares a kind's name with a string literal."""
    pattern = r"(\.kind|kind)\s*(==|!=|in|not in)\s*[\"'(]"
    out = subprocess.run(["grep", "-rnE", pattern, "fibjax", "launch", "--include=*.py"], cwd=ROOT, capture_output=True, text=True)
    offenders = [line for line in out.stdout.splitlines() if not line.startswith("fibjax/kinds/")]
    assert offenders == [], "\n".join(offenders)


def test_model_config_asks_the_kind_whether_its_layers_can_scan():
    with pytest.raises(ConfigError, match="scan_layers: needs every layer to run the same program"):
        ModelConfig(num_layers=4, scan_layers=True, attention=AttentionConfig(kind="offset", alpha="staggered"))
    assert ModelConfig(num_layers=4, scan_layers=True, attention=AttentionConfig(kind="offset", alpha="staggered", learn_alpha=True)).scan_layers


def test_loading_a_config_needs_no_kind_module():
    code = (
        "import sys, fibjax.config; fibjax.config.load_config_file('configs/cpu/fib_stagger_w8.py'); "
        "print(sorted(m for m in sys.modules if m.startswith('fibjax.kinds.') and m != 'fibjax.kinds.registry'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
