"""The ``window`` and ``sinks`` kinds (fibjax/kinds/window.py, fibjax/attention/window.py): the
XLA path against the dense oracle with a band mask, forward and backward, fp32 and bf16 (the
oracle's TOL / GRAD_TOL per dtype), GQA; StreamingLLM's sink positions; cached decoding against
the full forward in O(W) / O(S + W) rows; configs; a dense run evaluated under both by the CLI.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax import kinds
from fibjax.attention import sinks_attention, window_attention
from fibjax.attention.window import band_attention_xla
from fibjax.config import AttentionConfig, ConfigError, TrainConfig, apply_overrides, load_config_file
from fibjax.decode import plan_layers
from fibjax.model import Transformer
from fibjax.recipes import cpu
from tests import oracle
from tests.test_decode import TOL as DECODE_TOL
from tests.test_decode import cached_and_full, tiny
from tests.tiers import first_fast, slow

KEY = jax.random.PRNGKey(7)


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


# (dtype, batch, T, H, K, head dim, W, S, query chunk): T = 45 is no multiple of any chunk here
CASES = {
    "window_gqa_ragged": (jnp.float32, 2, 45, 4, 2, 16, 6, 0, 8),
    "sinks_gqa_overlapping": (jnp.float32, 2, 45, 4, 2, 16, 6, 8, 8),  # S > W: early queries' sinks are in the window
    "window_bf16": (jnp.bfloat16, 2, 45, 4, 2, 16, 6, 0, 8),
    "sinks_bf16": (jnp.bfloat16, 2, 45, 4, 2, 16, 6, 3, 8),
    "window_w1": (jnp.float32, 1, 45, 4, 2, 16, 1, 0, 8),  # itself only
    "window_wider_than_t": (jnp.float32, 1, 45, 4, 2, 16, 64, 0, None),  # dense causal
    "sinks_wider_than_t": (jnp.float32, 1, 45, 4, 2, 16, 64, 4, None),
    "sinks_w1_mha": (jnp.float32, 1, 45, 4, 4, 16, 1, 3, 16),  # sinks and the query itself
    "window_default_chunk": (jnp.float32, 1, 200, 4, 1, 16, 40, 0, None),  # chunks of 40, the last ragged
}


@pytest.mark.parametrize("name", first_fast(list(CASES), keep=2))
def test_forward_lse_and_gradients_match_the_band_oracle(name):
    dtype, b, t, h, kh, d, window, sinks, chunk = CASES[name]
    q, k, v = oracle.random_qkv(KEY, b, t, h, kh, d, dtype)
    q_sinks = jax.random.normal(jax.random.PRNGKey(8), q.shape).astype(dtype)  # sinks scored by queries of their own
    band = oracle.band_mask(t, window)
    union = oracle.band_mask(t, window, sinks)

    def ours(q, k, v, q_sinks):
        if sinks:
            return sinks_attention(q, k, v, sinks=sinks, window=window, q_sinks=q_sinks, return_lse=True, query_chunk=chunk)
        return window_attention(q, k, v, window=window, return_lse=True, query_chunk=chunk)

    def reference(q, k, v, q_sinks):
        return oracle.masked_attention(q, k, v, union, q_other=q_sinks if sinks else None, other_TT=union & ~band)

    out, lse = ours(q, k, v, q_sinks)
    ref_out, ref_lse = reference(q, k, v, q_sinks)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (b, t, h)
    _close(out, ref_out, oracle.TOL[dtype])
    _close(lse, ref_lse, oracle.TOL[dtype])
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape)
    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    got = jax.grad(lambda *a: jnp.sum(ours(*a)[0].astype(jnp.float32) * w), argnums)(q, k, v, q_sinks)
    ref = jax.grad(lambda *a: jnp.sum(reference(*a)[0] * w), argnums)(q, k, v, q_sinks)
    for g, r in zip(got, ref, strict=True):
        _close(g, r, oracle.GRAD_TOL[dtype])


def test_the_xla_path_is_banded_never_a_t_by_t_mask():
    """Forward + backward at W = 16, S = 4: no [T, T] array, and scratch memory linear in T
    (measured 5.0, 10.1, 20.1 MiB at T = 1024, 2048, 4096; jax.nn.dot_product_attention's XLA
    local window, a masked [T, T], took 64, 257, 1026 MiB)."""

    def scratch(t: int) -> tuple[int, str]:
        q, kv = (jax.ShapeDtypeStruct((1, t, h, 16), jnp.float32) for h in (4, 2))
        grad = jax.grad(lambda q, k, v: jnp.sum(band_attention_xla(q, k, v, q, window=16, sinks=4)), (0, 1, 2))
        lowered = jax.jit(grad).trace(q, kv, kv).lower()
        return lowered.compile().memory_analysis().temp_size_in_bytes, lowered.as_text()

    (small, text), (large, _) = scratch(2048), scratch(4096)
    assert "2048x2048" not in text
    assert large < 2.2 * small and small < 2048 * 2048 * 4 * 4 / 4  # a quarter of the 4 heads' [T, T] float32 scores


def test_arguments_are_checked_and_cpu_takes_the_xla_path():
    q, k, v = oracle.random_qkv(KEY, 1, 64, 4, 2, 16, jnp.bfloat16)
    np.testing.assert_array_equal(window_attention(q, k, v, window=8), window_attention(q, k, v, window=8, implementation="xla"))
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        window_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="sinks must be an int >= 0"):
        sinks_attention(q, k, v, sinks=-1, window=4)
    with pytest.raises(ValueError, match="implementation must be one of"):
        window_attention(q, k, v, window=8, implementation="cudnn")
    with pytest.raises(ValueError, match="q_sinks must have q's shape"):
        sinks_attention(q, k, v, sinks=2, window=4, q_sinks=q[:, :8])


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's sliding window needs a GPU")
def test_cudnn_sliding_window_matches_the_oracle_on_gpu():
    q, k, v = oracle.random_qkv(KEY, 2, 512, 8, 2, 64, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: window_attention(q, k, v, window=100))
    assert "cudnn" in f.lower(q, k, v).compile().as_text()
    _close(f(q, k, v), oracle.masked_attention(q, k, v, oracle.band_mask(512, 100))[0], oracle.TOL[jnp.bfloat16])


# --- the kinds --------------------------------------------------------------------------------


def test_the_kinds_answer_the_protocol_and_the_config_names_bad_fields():
    window, sinks = AttentionConfig(kind="window", window=256), apply_overrides(AttentionConfig(), ["kind=sinks", "sinks=4", "window=252"])
    w, s = kinds.kind_of(window), kinds.kind_of(sinks)
    assert (w.label(window), s.label(sinks)) == ("window 256", "sinks 4 + window 252")
    assert w.sparse and s.sparse and not w.bounded_context and not s.bounded_context  # a ring buffer: decode past the training length
    assert w.one_softmax and not s.one_softmax  # the sinks' scores are not dense attention's
    assert w.attended(window, None, 1024) == tuple(range(256)) and w.attended(window, None, 100) == tuple(range(100))
    assert s.attended(sinks, None, 1024) is None  # sinks are positions, not distances
    assert s.reachable(sinks, None, 4096) == set(range(256)) == s.reachable(sinks, None, 256)  # no new distance at 16x
    assert w.reachable(window, None, 64) == set(range(64))
    with pytest.raises(ConfigError, match=r"window: must be >= 1 for kind window \(got 0\)"):
        AttentionConfig(kind="window", window=0)
    with pytest.raises(ConfigError, match=r"sinks: must be >= 1 for kind sinks \(got 0\)"):
        apply_overrides(AttentionConfig(), ["kind=sinks", "sinks=0"])
    with pytest.raises(ConfigError, match="sinks: must be >= 0"):
        AttentionConfig(sinks=-1)
    assert AttentionConfig(kind="offset", window=0).window == 0  # offset's window may be empty


def test_a_sink_is_scored_at_its_stream_cache_position():
    """StreamingLLM's rule: past S + W - 1, a query sees its window and the sinks as if they were
    contiguous. So in one layer (nothing else mixes positions) the last token's logits do not
    change when the text between the sinks and the window is cut out."""
    model = Transformer(tiny(1, kind="sinks", sinks=2, window=5), rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.PRNGKey(4), (2, 40), 0, 97)
    cut = jnp.concatenate([x[:, :2], x[:, 20:]], axis=1)
    logits = model(x)
    np.testing.assert_allclose(logits[:, -1], model(cut)[:, -1], atol=1e-5, rtol=0)
    assert not np.allclose(logits[:, 20], model(x[:, 3:])[:, 17], atol=1e-3)  # the sinks differ: so do the logits


# (attention, dtype, capacity, prompt): each ring wraps in the prompt and again in the steps
DECODE = {
    "window": (dict(kind="window", window=5), "float32", 48, 8),
    "sinks_short_prompt": (dict(kind="sinks", sinks=3, window=6), "float32", 48, 2),  # the steps write sink row 2
    "sinks_bf16": (dict(kind="sinks", sinks=4, window=5), "bfloat16", 40, 12),
    "window_bf16": (dict(kind="window", window=7), "bfloat16", 40, 12),
}


@pytest.mark.parametrize("name", first_fast(list(DECODE), keep=2))
def test_cached_decoding_equals_the_full_forward_in_o_w_rows(name):
    attention, dtype, capacity, prompt = DECODE[name]
    model = Transformer(tiny(2, dtype, **attention), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, capacity), 0, 97)
    cached, full, decoder = cached_and_full(model, tokens, prompt)
    np.testing.assert_allclose(cached, full, atol=DECODE_TOL[dtype], rtol=0)
    w, s = attention["window"], attention.get("sinks", 0)
    cache = decoder.init_cache(2)
    assert all(p.rows == w for p in decoder.plans) and all(c.k.shape[2] == w for c in cache)
    assert all(sum(x.shape[2] for x in c) == 2 * (w + s) for c in cache)  # keys and values: W ring rows + S sink rows
    assert [p.rows for p in plan_layers(model, 65536)] == [w, w]  # the cache does not grow with the capacity


# --- configs and commands ----------------------------------------------------------------------


def test_the_equal_cost_window_has_stagger_w8s_keys_per_query():
    stagger = cpu("fib_stagger_w8")
    acfg = stagger.model.attention
    kind = kinds.kind_of(acfg)
    counts = [len(kind.attended(acfg, a, stagger.seq_len)) for a in acfg.layer_alphas(stagger.model.num_layers)]
    assert counts == [15, 15, 16, 16, 17, 16, 16, 16]  # the count the config's docstring states
    equal, wide = load_config_file("configs/cpu/window_equal_w8.py"), load_config_file("configs/cpu/window_w64.py")
    assert equal.model.attention.kind == "window" and equal.model.attention.window == round(np.mean(counts)) == 16
    assert wide.model.attention.window == 64
    assert dataclasses.replace(equal, name="x", model=dataclasses.replace(equal.model, attention=stagger.model.attention)) == dataclasses.replace(
        stagger, name="x"
    )


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, data_dir):
    from fibjax.train.loop import train
    from tests.helpers import TINY

    workdir = tmp_path_factory.mktemp("window_runs") / "dense"
    train(apply_overrides(TrainConfig(), [*TINY, "steps=2", f"data.path={data_dir}", "model.attention.kind=dense"]), workdir, progress=False)
    return workdir


def _reports(workdir) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in (workdir / "eval").glob("*.json")}


def test_a_dense_run_evaluates_under_window_and_sinks_from_the_command_line(dense_run, capsys):
    from launch.eval import main

    assert main(["--workdir", str(dense_run), "--lengths", "32,64"]) == 0
    assert main(["--workdir", str(dense_run), "--lengths", "32,64", "--attention", "kind=window", "window=64"]) == 0
    assert main(["--workdir", str(dense_run), "--lengths", "32,64", "--attention", "kind=sinks", "sinks=2", "window=6"]) == 0
    capsys.readouterr()
    by_kind = {r["attention"]["kind"]: r for r in _reports(dense_run).values()}
    nll = {kind: [x["nll"] for x in r["datasets"]["python_docs"]] for kind, r in by_kind.items()}
    np.testing.assert_allclose(nll["window"], nll["dense"], rtol=1e-5)  # 64 keys cover every query at 32 and 64
    assert by_kind["sinks"]["attention"]["sinks"] == 2 and all(abs(a - b) > 1e-4 for a, b in zip(nll["sinks"], nll["dense"]))
    assert by_kind["sinks"]["new_distances"]["64"] == [0, 0]  # sinks' distances stay within S + W


@slow
def test_launch_train_trains_a_window_model(tmp_path, data_dir):
    from tests.helpers import train_cmd

    rc, out = train_cmd(tmp_path / "w", data_dir, "steps=2", "model.attention.kind=window", "model.attention.window=8")
    assert rc == 0, out
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    assert saved["model"]["attention"]["kind"] == "window" and saved["model"]["attention"]["window"] == 8
