"""NSA attention against the loop-and-mask reference (tests/block_oracle.py), and NSA in the model.

Inputs are dyadic (tests/block_oracle.dyadic_qkv). NSA's ranking goes through exp and a sum of
probabilities, so it is not exact like MoBA's: the tests check that the float64 reference's
choice has a clear margin (``selection_margin``) before asking for the same blocks. Tolerances
(atol = rtol) against the float32 reference: output and lse fp32 2e-5, bf16 3e-2; gradients of
q, k, v, k_cmp, v_cmp and the gates fp32 1e-4, bf16 8e-2 (tests/oracle.py, as every path).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.attention import block_sparse, nsa, offset_attention
from fibjax.attention.block_sparse import block_sparse_attention_xla, select_blocks
from fibjax.attention.nsa import compress_blocks, compressed_attention_xla, nsa_attention, nsa_attention_xla, window_attention_xla
from fibjax.config import AttentionConfig, ConfigError, ModelConfig, SSAConfig, apply_overrides, load_config_file
from fibjax.model import SSAStreams, Transformer
from tests import block_oracle as bo
from tests import oracle
from tests.helpers import TINY_SPARSE, train_cmd
from tests.tiers import first_fast, slow

KEY = jax.random.PRNGKey(0)
DTYPES = [jnp.float32, jnp.bfloat16]
# (batch, T, q heads, kv heads, head dim, block, S, window): ragged tails, GQA, MHA, S above N, W past T,
# T below one block (nothing compressed)
CASES = [(2, 45, 6, 2, 8, 4, 3, 5), (1, 64, 4, 1, 16, 8, 4, 9), (2, 33, 2, 2, 4, 5, 2, 0), (1, 21, 4, 2, 8, 3, 9, 40), (1, 5, 2, 1, 4, 8, 2, 3)]


def _close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _inputs(case, dtype=jnp.float32, seed=0):
    """q, k, v, compressed k and v (independent of k, v: the function takes any), gates in (0, 1)."""
    b, t, h, kh, d, block, _, _ = case
    q, k, v = bo.dyadic_qkv(jax.random.PRNGKey(seed), b, t, h, kh, d, dtype)
    _, kc, vc = bo.dyadic_qkv(jax.random.PRNGKey(seed + 1), b, t // block, h, kh, d, dtype)
    gates = jax.random.uniform(jax.random.PRNGKey(seed + 2), (b, t, h, 3))
    return q, k, v, kc, vc, gates


def _kwargs(case):
    return dict(block_size=case[5], num_blocks=case[6], window=case[7])


def test_compression_matches_loops_and_starts_at_the_block_mean():
    x = bo.dyadic_qkv(KEY, 2, 27, 2, 2, 4)[1]  # T = 27: 3 blocks of 8, the ragged tail dropped
    ks = jax.random.split(KEY, 3)
    pos, w_in, w_out = (jax.random.normal(key, shape) for key, shape in zip(ks, [(8, 4), (32, 4), (4, 4)]))
    got = compress_blocks(x, pos, w_in, w_out)
    assert got.shape == (2, 3, 2, 4)
    _close(got, bo.compress_reference(x, pos, w_in, w_out), dict(atol=1e-5, rtol=1e-5))
    mean = compress_blocks(x, pos, w_in, jnp.zeros((4, 4)))  # the model's initial W_out
    _close(mean, np.asarray(x[:, :24]).reshape(2, 3, 8, 2, 4).mean(axis=2), dict(atol=1e-6, rtol=0))


@pytest.mark.parametrize("case", first_fast(CASES, keep=2))
def test_selection_ranks_by_group_summed_compressed_probabilities(case):
    q, k, _, kc, _, _ = _inputs(case)
    block, s = case[5], case[6]
    scores = bo.selection_scores(q, k, block, "nsa_prob", kc)
    assert bo.selection_margin(scores, block, s) > 1e-5  # no near-tie: float32 must agree
    idx = select_blocks(q, k, block_size=block, num_blocks=s, block_rank="nsa_prob", rank_keys=kc)
    want = bo.selected_blocks(q, k, block, s, scores=scores)
    np.testing.assert_array_equal(bo.indices_to_blocks(idx, want.shape[-1]), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", first_fast(CASES, keep=2))
def test_forward_matches_oracle(dtype, case):
    q, k, v, kc, vc, gates = _inputs(case, dtype)
    out, lse = nsa_attention(q, k, v, kc, vc, gates, **_kwargs(case), return_lse=True)
    ref, ref_lse = bo.nsa_reference(q, k, v, kc, vc, gates, *case[5:])
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    _close(out, ref, bo.TOL[dtype])
    _close(lse, ref_lse, bo.TOL[dtype])


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "window", "query_chunk", "window_chunk"))
def _grads(args, w, *, block_size, num_blocks, window, query_chunk=512, window_chunk=512):
    kw = dict(block_size=block_size, num_blocks=num_blocks, window=window, query_chunk=query_chunk, window_chunk=window_chunk)
    f = lambda *a: jnp.sum(nsa_attention_xla(*a, **kw).astype(jnp.float32) * w)
    return jax.grad(f, tuple(range(6)))(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", first_fast(CASES[:2]))
def test_gradients_match_oracle(dtype, case):
    args = _inputs(case, dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), args[0].shape)
    chosen = bo.selected_blocks(*args[:2], case[5], case[6], "nsa_prob", args[3])  # the choice has no gradient
    f = lambda *a: jnp.sum(bo.nsa_reference(*a, *case[5:], chosen=chosen)[0] * w)
    ref = jax.jit(jax.grad(f, tuple(range(6))))(*args)
    for g, r, a in zip(_grads(args, w, **_kwargs(case)), ref, args):
        assert g.dtype == a.dtype
        _close(g, r, bo.GRAD_TOL[dtype])


def test_query_chunks_change_nothing():
    """The lax.map paths (several chunks, a padded tail) equal one chunk, forward and backward."""
    case = CASES[0]
    args = _inputs(case)
    w = jax.random.normal(jax.random.PRNGKey(2), args[0].shape)
    one = nsa_attention_xla(*args, **_kwargs(case), return_lse=True, query_chunk=512, window_chunk=512)
    for chunk in (4, 12):
        many = nsa_attention_xla(*args, **_kwargs(case), return_lse=True, query_chunk=chunk, window_chunk=chunk - 1)
        for a, r in zip(many, one):
            _close(a, r, bo.TOL[jnp.float32])
        for a, r in zip(_grads(args, w, **_kwargs(case), query_chunk=chunk, window_chunk=chunk - 1), _grads(args, w, **_kwargs(case))):
            _close(a, r, bo.GRAD_TOL[jnp.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, chunk", first_fast([(5, 4), (40, 7), (0, 3), (9, 64)], keep=2, unpack=True))
def test_window_branch_matches_oracle(dtype, window, chunk):
    """The band's flash forward and its own backward, in chunks that do not divide T (padded),
    smaller and larger than the window, and a window past T."""
    q, k, v = bo.dyadic_qkv(KEY, 2, 37, 6, 2, 8, dtype)
    w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    allowed = jnp.asarray(oracle.distance_mask(37, range(window + 1)))
    out = window_attention_xla(q, k, v, window=window, query_chunk=chunk)
    assert out.dtype == dtype
    _close(out, oracle.masked_attention(q, k, v, allowed)[0], bo.TOL[dtype])
    grads = jax.grad(lambda *a: jnp.sum(window_attention_xla(*a, window=window, query_chunk=chunk).astype(jnp.float32) * w), (0, 1, 2))(q, k, v)
    refs = jax.grad(lambda *a: jnp.sum(oracle.masked_attention(*a, allowed)[0] * w), (0, 1, 2))(q, k, v)
    for g, r in zip(grads, refs):
        _close(g, r, bo.GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", first_fast(DTYPES))
def test_compressed_branch_in_runs_matches_oracle(dtype):
    """The compressed branch in mapped chunks over several runs (each reading the blocks before
    its end), forward and gradients."""
    q, k, v, kc, vc, _ = _inputs((1, 90, 4, 2, 8, 4, 3, 5), dtype)
    w = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    run = functools.partial(compressed_attention_xla, block_size=4, query_chunk=8)  # 12 chunks in 8 runs
    _close(run(q, kc, vc), bo.compressed_reference(q, kc, vc, 4), bo.TOL[dtype])
    grads = jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32) * w), (0, 1, 2))(q, kc, vc)
    refs = jax.grad(lambda *a: jnp.sum(bo.compressed_reference(*a, 4) * w), (0, 1, 2))(q, kc, vc)
    for g, r in zip(grads, refs):
        _close(g, r, bo.GRAD_TOL[dtype])


@pytest.mark.parametrize("t, chunk", first_fast([(700, 256), (300, 16), (45, 256)], keep=2, unpack=True))
def test_choice_from_the_compressed_softmax_is_block_sparse_choice(t, chunk):
    """NSA ranks from its compressed branch's probabilities; block_sparse's nsa_prob rule
    recomputes them: the same blocks in the same order, ties included (all-equal compressed keys:
    every earlier block scores alike, so the lowest ones, in order)."""
    q, k, _ = jax.random.normal(KEY, (3, 2, t, 4, 8)).astype(jnp.float32)
    k = k[:, :, :2]
    kc = jax.random.normal(jax.random.PRNGKey(1), (2, t // 4, 2, 8))
    for rank_keys in (kc, jnp.zeros_like(kc)):
        _, _, got = nsa._compressed_and_choice(q, rank_keys, rank_keys, block=4, top=5, query_chunk=chunk)
        want = block_sparse._chosen_blocks(q, k, rank_keys, block=4, top=5, rule="nsa_prob", chunk=chunk)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    own = np.arange(t) // 4
    lowest = np.where(np.arange(5)[None, :] < own[:, None], np.arange(5)[None, :], -1)
    np.testing.assert_array_equal(np.asarray(got)[0, 0, :t, 1:], lowest)


def test_gates_at_extremes_select_one_branch():
    """One-hot gates give each branch alone, checked against the library's other paths."""
    case = CASES[0]
    q, k, v, kc, vc, gates = _inputs(case)
    block, s, window = case[5:]
    branches = [
        compressed_attention_xla(q, kc, vc, block_size=block),
        block_sparse_attention_xla(q, k, v, block_size=block, num_blocks=s, block_rank="nsa_prob", rank_keys=kc),
        offset_attention(q, k, v, distances=range(window + 1)),
    ]
    _close(branches[0], bo.compressed_reference(q, kc, vc, block), bo.TOL[jnp.float32])
    assert np.all(np.asarray(branches[0][:, : block - 1]) == 0)  # before the end of block 0: nothing compressed
    for i, want in enumerate(branches):
        one_hot = jnp.broadcast_to(jnp.eye(3)[i], gates.shape)
        _close(nsa_attention(q, k, v, kc, vc, one_hot, **_kwargs(case)), want, bo.TOL[jnp.float32])


def test_causality_of_the_function_with_learned_compression():
    """Changing q, k, v and gates from position p on changes no output before p (the compressed
    blocks are made from k and v, so a block containing p is hidden until it is complete)."""
    b, t, h, kh, d, block, s, window = CASES[0]
    p = 29  # inside block 7 (28 .. 31)
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    weights = [jax.random.normal(key, shape) * 0.3 for key, shape in zip(ks, [(block, d), (block * d, d), (d, d)])]

    def run(q, k, v, gates):
        return nsa_attention(q, k, v, compress_blocks(k, *weights), compress_blocks(v, *weights), gates, **_kwargs(CASES[0]))

    a_in = _inputs(CASES[0])
    n_in = _inputs(CASES[0], seed=9)
    changed = [jnp.concatenate([x[:, :p], n[:, p:]], axis=1) for x, n in zip(a_in, n_in)]
    a, c = run(*a_in[:3], a_in[5]), run(*changed[:3], changed[5])
    np.testing.assert_array_equal(np.asarray(a[:, :p]), np.asarray(c[:, :p]))
    assert not np.allclose(a[:, p:], c[:, p:])


def _tiny(kind="nsa", **attention):
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attention=AttentionConfig(kind=kind, block_size=8, num_blocks=2, window=3, **attention),
    )


def test_model_is_causal():
    model = Transformer(_tiny(), rngs=nnx.Rngs(0))
    params = [v for block in model.blocks for v in jax.tree.leaves(nnx.state(block.attn.nsa, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))]
    for i, var in enumerate(params):  # move off the initial point (P = W_out = 0, gates 1/2), so every part acts
        var[...] = jax.random.normal(jax.random.PRNGKey(i), var.shape) * 0.3
    tokens = jax.random.randint(KEY, (2, 40), 0, 64)
    p = 21
    other = tokens.at[:, p:].set((tokens[:, p:] + 7) % 64)
    a, b = model(tokens), model(other)
    np.testing.assert_array_equal(np.asarray(a[:, :p]), np.asarray(b[:, :p]))
    assert not np.allclose(a[:, p:], b[:, p:])


def test_bad_arguments_raise():
    case = CASES[0]
    q, k, v, kc, vc, gates = _inputs(case)
    with pytest.raises(ValueError, match="k_cmp must be"):
        nsa_attention(q, k, v, kc[:, :-1], vc, gates, **_kwargs(case))
    with pytest.raises(ValueError, match="gates must be"):
        nsa_attention(q, k, v, kc, vc, gates[..., :2], **_kwargs(case))
    with pytest.raises(ValueError, match="window must be"):
        nsa_attention(q, k, v, kc, vc, gates, block_size=4, num_blocks=3, window=-1)
    with pytest.raises(ValueError, match="num_blocks must be"):
        nsa_attention(q, k, v, kc, vc, gates, block_size=4, num_blocks=0, window=2)


def test_config_and_parameters():
    assert AttentionConfig(kind="nsa").kind == "nsa" and SSAConfig(sparse_kind="nsa").sparse_kind == "nsa"
    for bad, field in ((dict(kind="nsa2"), "kind"), (dict(block_rank="mean"), "block_rank"), (dict(block_size=0), "block_size")):
        with pytest.raises(ConfigError, match=field):
            AttentionConfig(**bad)
    with pytest.raises(ConfigError, match="sparse_kind"):
        SSAConfig(sparse_kind="moba")
    with pytest.raises(ConfigError, match="nsa_params"):
        apply_overrides(_tiny("dense"), ["attention.nsa_params=3"])
    shapes = jax.tree.map(lambda x: x.shape, nnx.state(Transformer(_tiny(), rngs=nnx.Rngs(0)).blocks[0].attn.nsa, nnx.Param))
    assert nnx.to_pure_dict(shapes) == {"gate": {"kernel": (32, 12)}, **{f"{x}_compress": {"pos": (8, 8), "w_in": (64, 8), "w_out": (8, 8)} for x in "kv"}}
    assert not hasattr(Transformer(_tiny("dense"), rngs=nnx.Rngs(0)).blocks[0].attn, "nsa")
    dense = Transformer(_tiny("dense"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs NSA parameters"):  # a dense model evaluated with nsa attention
        dense.blocks[0].attn.attend(
            *dense.blocks[0].attn.qkv(jnp.zeros((1, 8, 32)), jnp.zeros((1, 8), jnp.int32)), _tiny().attention, x_BTD=jnp.zeros((1, 8, 32))
        )


def test_ssa_two_streams_with_an_nsa_sparse_stream():
    """SSA's layer with ssa.sparse_kind=nsa passes on the chosen stream: the NSA model's output
    (same parameters) or the dense one's."""
    tokens = jax.random.randint(KEY, (2, 40), 0, 64)
    ssa_model = Transformer(_tiny("dense", nsa_params=True), rngs=nnx.Rngs(0))
    nsa_model = Transformer(_tiny("nsa"), rngs=nnx.Rngs(0))
    for use_sparse, reference in ((True, nsa_model(tokens)), (False, ssa_model(tokens))):
        out, sown = nnx.capture(ssa_model, nnx.Intermediate)(tokens, ssa=SSAStreams(_tiny("nsa").attention, jnp.asarray(use_sparse)))
        np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)
        assert len(jax.tree.leaves(sown)) == 2


SMALL = [*TINY_SPARSE, "steps=20", "checkpoint.every_steps=20", "model.attention.window=7"]


@slow
@pytest.mark.parametrize("method", ["nsa", "ssa_nsa"])
def test_short_cpu_runs_learn(method, data_dir, tmp_path):
    from fibjax.train.metrics import read_metrics

    extra = ["model.attention.kind=dense", "model.attention.nsa_params=true", "ssa.enabled=true", "ssa.sparse_kind=nsa"] if method == "ssa_nsa" else []
    # A subprocess without JAX's persistent compilation cache: on 8 CPU devices this step, loaded
    # from a warm cache, aborts the process (a JAX fault, BUILD_NOTES "Tests and CI").
    no_cache = {"JAX_ENABLE_COMPILATION_CACHE": "false"}
    rc, out = train_cmd(tmp_path / method, data_dir, "--config", "configs/ssa/cpu_nsa.py", *SMALL, *extra, "data.weights=", env=no_cache)
    assert rc == 0, out
    rows = read_metrics(tmp_path / method)
    loss = [r["loss"] for r in rows if "loss" in r]
    assert len(loss) == 20 and np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.5
    assert all(("align" in r) == (method == "ssa_nsa") for r in rows)


@pytest.mark.parametrize("platform", first_fast(["cuda", "tpu"]))
def test_paper_shape_initialises_abstractly_and_lowers(platform):
    import dataclasses

    from fibjax import sharding
    from fibjax.config import MeshConfig
    from fibjax.train import step

    cfg = dataclasses.replace(load_config_file("configs/ssa/paper_nsa.py"), mesh=MeshConfig(data=-1), global_batch=1)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = step.build(cfg, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state["params"]))
    assert 1.1e9 < n_params < 1.3e9  # the MoBA model's plus 16 x 0.34M for gates and compression
    batch = jax.ShapeDtypeStruct((1, cfg.seq_len + 1), jnp.int32, sharding=trainer.batch_sharding)
    with jax.set_mesh(mesh):
        lowered = trainer.step.trace(trainer.abstract_state, batch).lower(lowering_platforms=(platform,))
    assert lowered.as_text()


def test_ssa_with_an_nsa_stream_needs_its_parameters_and_budgets_apply_to_nsa():
    from fibjax.decode import plan_layers
    from fibjax.eval.runner import inference_overrides

    cfg = load_config_file("configs/ssa/cpu_nsa.py")
    with pytest.raises(ConfigError, match="nsa_params"):
        apply_overrides(cfg, ["model.attention.kind=dense", "ssa.enabled=true", "ssa.sparse_kind=nsa"])
    assert inference_overrides(cfg, "sparse", num_blocks=2) == ["kind=nsa", "num_blocks=2"]
    with pytest.raises(ConfigError, match="sized by the trained block size"):
        inference_overrides(cfg, "sparse", block_size=8)
    # decoding plans NSA's rule for NSA layers and keeps a MoBA layer's own rule (tests/test_decode.py decodes both)
    moba = Transformer(_tiny("block_sparse", block_rank="nsa_prob"), rngs=nnx.Rngs(0))
    nsa = Transformer(_tiny("nsa"), rngs=nnx.Rngs(0))
    assert plan_layers(moba, 64)[0].rank == "nsa_prob" and plan_layers(nsa, 64)[0].rank == "nsa_prob"


@pytest.mark.parametrize("dtype", first_fast(DTYPES))
def test_compressed_branch_lse_and_its_gradient_match_oracle(dtype):
    """The compressed branch's own backward (p from the saved lse) through both outputs: the lse's
    cotangent joins the softmax's (ds = p (dp - delta + dlse)). Queries before the end of block 0
    see no block (out 0, lse -inf) and are left out of the comparison."""
    block, t = 4, 90
    q, _, _, kc, vc, _ = _inputs((1, t, 4, 2, 8, block, 3, 5), dtype)
    w_out, w_lse = jax.random.normal(jax.random.PRNGKey(4), q.shape), jax.random.normal(jax.random.PRNGKey(5), q.shape[:3])
    seen_T = jnp.arange(t) >= block - 1
    past_TN = (jnp.arange(t // block)[None, :] + 1) * block - 1 <= jnp.arange(t)[:, None]

    def loss(out, lse):
        lse = jnp.where(seen_T[None, :, None], lse, 0.0)  # -inf where no block is seen
        return jnp.sum(out.astype(jnp.float32) * w_out * seen_T[None, :, None, None]) + jnp.sum(lse * w_lse)

    run = lambda *a: compressed_attention_xla(*a, block_size=block, query_chunk=8, return_lse=True)  # noqa: E731
    # the oracle with a key allowed to the unseen rows (their NaN-free stand-in; weighted 0 above)
    ref = lambda *a: oracle.masked_attention(*a, past_TN | ~seen_T[:, None])  # noqa: E731
    out, lse = run(q, kc, vc)
    ref_out, ref_lse = ref(q, kc, vc)
    _close(out * seen_T[None, :, None, None], ref_out * seen_T[None, :, None, None], bo.TOL[dtype])
    _close(jnp.where(seen_T[None, :, None], lse, 0.0), jnp.where(seen_T[None, :, None], ref_lse, 0.0), bo.TOL[dtype])
    assert bool(jnp.all(jnp.isneginf(lse[:, : block - 1])))
    grads = jax.grad(lambda *a: loss(*run(*a)), (0, 1, 2))(q, kc, vc)
    refs = jax.grad(lambda *a: loss(*ref(*a)), (0, 1, 2))(q, kc, vc)
    for g, r in zip(grads, refs):
        assert g.dtype == dtype
        _close(g, r, bo.GRAD_TOL[dtype])
