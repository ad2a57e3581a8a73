"""Cached decoding (fibjax.decode) against the full forward, the samplers, and launch.sample.

Tolerances on logits (cached vs full forward over the same tokens, same weights; logits here
reach |4.6|): float32 atol 1e-4 (the two differ only in summation order; measured <= 4.4e-6);
bfloat16 atol 0.05 (activations rounded to 8 bits in another order; measured 7.8e-3).
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.attention import alpha_to_logit, attended_distances
from fibjax.config import AttentionConfig, CheckpointConfig, DataConfig, EvalConfig, ModelConfig, TrainConfig
from fibjax.data import train_tokenizer
from fibjax.decode import GREEDY, Decoder, Sampler, TextStreamer, plan_layers, top_k_mask, top_p_mask
from fibjax.decode import run as run_lib
from fibjax.model import Transformer
from launch import sample
from tests.tiers import first_fast

TOL = {"float32": 1e-4, "bfloat16": 0.05}


def tiny(num_layers=3, dtype="float32", **attention) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, dtype=dtype, attention=AttentionConfig(**attention))


def cached_and_full(model, tokens_BT, prompt_len: int):
    """Logits at positions prompt_len-1 .. T-1: from prefill + one step per token, and from one full forward."""
    t = tokens_BT.shape[1]
    full = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens_BT))[:, prompt_len - 1 :]
    decoder = Decoder(model, max_len=t)
    cache, logits, _ = decoder.prefill(tokens_BT[:, :prompt_len])
    rows = [logits]
    for pos in range(prompt_len, t):
        cache, logits, _ = decoder.step(cache, tokens_BT[:, pos], pos)
        rows.append(logits)
    return np.stack([np.asarray(r) for r in rows], 1), full, decoder


def with_alphas(model, alphas):
    for block, a in zip(model.blocks, alphas):
        block.attn.alpha_logit[...] = jnp.asarray(alpha_to_logit(a), jnp.float32)
    return model


# (attention, layers, capacity, prompt): each capacity is past some layer's ring buffer, and
# the prompt ends before another buffer's end, so rows wrap both in the prefill and in steps.
CASES = {
    "dense": (dict(kind="dense"), 2, 48, 8),
    # alpha 1: distances up to 987, 988 rows, crossed at position 988 by a step
    "fib_fixed": (dict(kind="offset", alpha="fixed", window=2), 1, 1000, 970),
    # alphas 0.5 / 1 / 1.5: 495 rows (wrapped twice), 988 (crossed by a step), 916 (1.5 x 610 + 1)
    "fib_staggered": (dict(kind="offset", alpha="staggered", window=3), 3, 1000, 970),
    # 5 layers: coprime slots 0 2 4 1 3 (alphas 0.5 1.0 1.5 0.75 1.25), unlike the linear order
    "fib_coprime": (dict(kind="offset", alpha="coprime", window=3), 5, 1000, 970),
    # pow2 at capacity 200: rungs up to 128; alpha 0.5 attends 64 from the prompt's position 64 on
    "pow2_staggered": (dict(kind="offset", alpha="staggered", base="pow2", window=2), 3, 200, 150),
    "bf16_fib_staggered": (dict(kind="offset", alpha="staggered", window=3, dtype="bfloat16"), 2, 200, 150),
}


@pytest.mark.parametrize("name", first_fast(list(CASES), keep=3))
def test_cached_logits_equal_the_full_forward(name):
    attention, layers, capacity, prompt = CASES[name]
    attention = dict(attention)  # a copy: popping "dtype" from CASES itself would run a rerun in float32
    dtype = attention.pop("dtype", "float32")
    model = Transformer(tiny(layers, dtype, **attention), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, capacity), 0, 97)
    cached, full, decoder = cached_and_full(model, tokens, prompt)
    # every offset case (bf16 too) has a ring buffer that wraps; dense keeps every row
    assert any(p.rows < capacity for p in decoder.plans) == (attention["kind"] == "offset")
    np.testing.assert_allclose(cached, full, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("base,capacity,prompt,alphas", first_fast([("fibonacci", 880, 820, [0.73, 1.37]), ("pow2", 200, 150, [0.73])], unpack=True))
def test_learned_path_at_non_integer_alpha(base, capacity, prompt, alphas):
    """Every rung interpolates between lo and lo + 1 (frac != 0); 0.73 x 987 = 720.5, 1.37 x 610 = 835.7."""
    model = with_alphas(Transformer(tiny(len(alphas), kind="offset", alpha="learned", base=base, window=3), rngs=nnx.Rngs(0)), alphas)
    np.testing.assert_allclose([float(a) for a in model.alphas()], alphas, rtol=1e-6)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, capacity), 0, 97)
    cached, full, decoder = cached_and_full(model, tokens, prompt)
    assert all(p.kind.name == "interpolated" and p.rows < capacity for p in decoder.plans)
    np.testing.assert_allclose(cached, full, atol=TOL["float32"], rtol=0)


def test_ring_buffers_hold_the_largest_distance_and_do_not_grow():
    cfg = tiny(4, kind="offset", alpha="staggered", window=12)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    for capacity in (300, 4096, 65536):
        rows = [p.rows for p in plan_layers(model, capacity)]
        assert rows == [max(attended_distances(window=12, base="fibonacci", alpha=a, seq_len=capacity)) + 1 for a in model.alphas()]
    assert rows == [495, 823, 1152, 1481]  # round(alpha * 987) + 1, whatever the capacity past 1481
    dense = Transformer(tiny(2, kind="dense"), rngs=nnx.Rngs(0))
    assert [p.rows for p in plan_layers(dense, 4096)] == [4096, 4096]
    learned = with_alphas(Transformer(tiny(2, kind="offset", alpha="learned", window=12), rngs=nnx.Rngs(0)), [0.73, 1.37])
    # far neighbour of the largest rung (floor(alpha * 987) + 1) and one row of margin
    assert [p.rows for p in plan_layers(learned, 65536)] == [720 + 3, 1352 + 3]


def test_greedy_generation_is_the_argmax_of_the_full_forward_and_never_recompiles():
    model = Transformer(tiny(2, kind="offset", alpha="staggered", window=3), rngs=nnx.Rngs(0))
    prompts = jax.random.randint(jax.random.PRNGKey(3), (2, 1, 7), 0, 97)
    decoder = Decoder(model, max_len=40)
    for prompt in prompts:
        tokens = np.concatenate(list(decoder.generate(prompt, 33, sampler=GREEDY)))
        full = np.asarray(model(jnp.concatenate([prompt, tokens[None]], axis=1)))
        np.testing.assert_array_equal(tokens, full[0, 6:-1].argmax(-1))
    assert dict(decoder.traces) == {"prefill": 1, "step": 1}  # one trace for 2 x 32 steps


def test_seeded_sampling_is_reproducible_never_recompiles_and_stops_at_the_stop_token():
    model = Transformer(tiny(1, kind="offset", alpha="fixed", window=3), rngs=nnx.Rngs(0))
    decoder = Decoder(model, max_len=30)
    prompt = np.zeros((2, 5), np.int32)
    sampler = Sampler(temperature=2.0, top_k=60, top_p=0.99)
    run = lambda seed, stop=None: np.stack(list(decoder.generate(prompt, 25, sampler=sampler, seed=seed, stop_token=stop)))  # noqa: E731
    a, b, c = run(0), run(0), run(1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (25, 2) and not np.array_equal(a, c)
    stop = int(a[3, 0])
    stopped = run(0, stop)
    np.testing.assert_array_equal(stopped, a[: len(stopped)])  # the same draws: position n uses fold_in(key, n)
    assert all(stop in stopped[:, r] for r in range(2)) or len(stopped) == 25
    assert stop not in stopped[:-1, 0] or stop not in stopped[:-1, 1]  # it ran until both rows had produced it
    assert dict(decoder.traces) == {"prefill": 1, "step": 1}


def test_top_k_and_top_p_masks():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    np.testing.assert_array_equal(top_k_mask(logits, 2), [[False, True, False, True], [True, True, True, True]])  # ties kept
    np.testing.assert_array_equal(top_p_mask(logits, 0.5), [[False, True, False, False], [True] * 4])  # ties kept
    np.testing.assert_array_equal(top_p_mask(logits, 0.75), [[False, True, False, True], [True] * 4])
    np.testing.assert_array_equal(top_p_mask(logits[:1], 0.81), [[False, True, True, True]])
    np.testing.assert_array_equal(top_p_mask(logits[:1], 0.01), [[False, True, False, False]])  # never empty
    filtered = Sampler(temperature=1.0, top_k=3, top_p=0.8, vocab_size=3).filtered_logits(logits)
    np.testing.assert_array_equal(np.isfinite(filtered[0]), [False, True, True, False])  # id 3 is past the tokenizer


def test_samplers_follow_their_distribution():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    draw = lambda s: np.asarray(jax.vmap(lambda k: s(logits, k))(keys))[:, 0]  # noqa: E731
    np.testing.assert_array_equal(draw(GREEDY), 3)
    np.testing.assert_allclose(np.bincount(draw(Sampler()), minlength=4) / 4000, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    tempered = np.array([0.1, 0.2, 0.3, 0.4]) ** 2
    np.testing.assert_allclose(np.bincount(draw(Sampler(temperature=0.5)), minlength=4) / 4000, tempered / tempered.sum(), atol=0.03)
    np.testing.assert_allclose(np.bincount(draw(Sampler(top_k=2)), minlength=4) / 4000, [0, 0, 3 / 7, 4 / 7], atol=0.03)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(top_p=0.0)


def test_text_streamer_prints_complete_characters_only():
    tokenizer = train_tokenizer(["hello world, the quick brown fox.\nfoo bar baz qux " * 20], 300)
    prompt = tokenizer.encode("Say:")
    new = tokenizer.encode(" héllo 🙂 wörld\n  tabs\tand ✓")
    streamer = TextStreamer(tokenizer, prompt)
    pieces = [streamer.push(t) for t in new] + [streamer.finish()]
    assert "".join(pieces) == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    assert not any("\ufffd" in p for p in pieces)  # the emoji's four byte pieces come out as one character


# --- launch.sample on a real (tiny) run -------------------------------------------------------


def tiny_run(tmp_path_factory, kind: str):
    from fibjax.train.loop import train

    workdir = tmp_path_factory.mktemp("runs") / f"tiny_{kind}"
    attention = AttentionConfig(kind="offset", alpha="staggered", window=4) if kind == "offset" else AttentionConfig(kind=kind)
    cfg = TrainConfig(
        name="tiny",
        steps=2,
        seq_len=32,
        global_batch=8,
        model=ModelConfig(vocab_size=384, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, attention=attention),
        data=DataConfig(default_vocab_size=384),
        checkpoint=CheckpointConfig(every_steps=2, async_save=False),
        eval=EvalConfig(at_end=False),
    )
    train(cfg, workdir, progress=False)
    return workdir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tiny_run(tmp_path_factory, "offset")


@pytest.fixture(scope="module")
def dense_run_dir(tmp_path_factory):
    """Trained dense: a checkpoint records its model, so a dense run cannot be made by editing config.json."""
    return tiny_run(tmp_path_factory, "dense")


def variant(run_dir, tmp_path, edit=None):
    """A copy of the run (same weights), its config changed by ``edit``."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    if edit:
        path = copy / "config.json"
        cfg = json.loads(path.read_text())
        edit(cfg)
        path.write_text(json.dumps(cfg))
    return copy


def cli(capsys, *argv):
    rc = sample.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_sample_streams_a_continuation(run_dir, capsys, tmp_path):
    """With --greedy, the prompt and then the text of 12 tokens of greedy decoding computed here
    with full forwards, no cache (one padded length: the model is causal); sampled with --top-k,
    a continuation of the prompt."""
    prompt, new = "The for statement", 12
    rc, out, err = cli(capsys, "--workdir", run_dir, "--prompt", prompt, "--max-new-tokens", new, "--greedy", "--ignore-eos")
    assert rc == 0 and "step 2" in err
    loaded = run_lib.load(run_dir)
    tok, forward = loaded.tokenizer, nnx.jit(lambda m, x: m(x))
    ids = tok.encode(prompt)
    total = len(ids) + new
    while len(ids) < total:
        logits = forward(loaded.model, jnp.asarray([ids + [0] * (total - len(ids))]))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1, : tok.vocab_size])))
    assert out == prompt + tok.decode(ids)[len(tok.decode(ids[:-new])) :] + "\n", (out, ids)
    rc, out, err = cli(capsys, "--workdir", run_dir, "--prompt", prompt, "--max-new-tokens", new, "--top-k", 40, "--seed", 3)
    assert rc == 0 and out.startswith(prompt) and len(out) > len(prompt) and "step 2" in err


def test_sample_under_sparse_inference(dense_run_dir, capsys, tmp_path):
    """A dense run sampled with --inference-mode sparse: MoBA blocks of the given budget, decoded with block sums."""
    dense = variant(dense_run_dir, tmp_path)
    rc, out, err = cli(
        capsys,
        "--workdir",
        dense,
        "--prompt",
        "The for statement",
        "--max-new-tokens",
        20,
        "--greedy",
        "--inference-mode",
        "sparse",
        "--num-blocks",
        2,
        "--block-size",
        4,
    )
    assert rc == 0 and out.startswith("The for statement"), err
    loaded = run_lib.load(dense, attention_overrides=["kind=block_sparse", "num_blocks=2", "block_size=4"])
    assert loaded.model.cfg.attention.kind == "block_sparse" and loaded.model.cfg.attention.num_blocks == 2
    tokens = jnp.asarray([loaded.tokenizer.encode("def f(x):\n    return x * 2\n" * 4)[:40]])
    cached, full, decoder = cached_and_full(loaded.model, tokens, 9)
    assert decoder.plans[0].kind.name == "block_sparse"
    np.testing.assert_allclose(cached, full, atol=TOL["float32"], rtol=0)

    def as_ssa(c):
        c["ssa"].update(enabled=True, sparse_kind="block_sparse")

    ssa = variant(dense_run_dir, tmp_path / "ssa", as_ssa)  # an SSA run decodes under either stream alone
    for mode, kind in (("sparse", "block_sparse"), ("full", "dense")):
        rc, out, err = cli(capsys, "--workdir", ssa, "--prompt", "The for statement", "--max-new-tokens", 4, "--greedy", "--inference-mode", mode)
        assert rc == 0 and out.startswith("The for statement"), err
        assert run_lib.load(ssa, attention_overrides=[f"kind={kind}"]).model.cfg.attention.kind == kind


def test_trained_run_decodes_like_its_full_forward_past_the_training_length(run_dir):
    """Trained at 32 tokens; a 20-token prompt and 60 new tokens run to 80."""
    loaded = run_lib.load(run_dir)
    tokens = jnp.asarray([loaded.tokenizer.encode("def f(x):\n    return x * 2\n\nclass A:\n    pass\n" * 4)[:80]])
    cached, full, _ = cached_and_full(loaded.model, tokens, 20)
    np.testing.assert_allclose(cached, full, atol=TOL["float32"], rtol=0)


def test_sample_errors(run_dir, capsys, tmp_path):
    rc, _, err = cli(capsys, "--workdir", tmp_path / "nowhere", "--prompt", "x")
    assert rc == 2 and "does not exist" in err
    rc, _, err = cli(capsys, "--workdir", run_dir, "--prompt", "")
    assert rc == 2 and "prompt is empty" in err
    (tmp_path / "empty.txt").write_text("")
    rc, _, err = cli(capsys, "--workdir", run_dir, "--prompt-file", tmp_path / "empty.txt")
    assert rc == 2 and "prompt is empty" in err
    rc, _, err = cli(capsys, "--workdir", run_dir, "--prompt-file", tmp_path / "missing.txt")
    assert rc == 2 and "cannot read --prompt-file" in err
    rc, _, err = cli(capsys, "--workdir", run_dir, "--prompt", "x", "--top-p", 1.5)
    assert rc == 2 and "top_p" in err
    rc, _, err = cli(capsys, "--workdir", run_dir, "--prompt", "x", "--step", 7)
    assert rc == 2 and "no checkpoint for step 7" in err


def test_sample_refuses_a_prompt_longer_than_a_dense_model_takes(run_dir, dense_run_dir, capsys, tmp_path):
    dense = variant(dense_run_dir, tmp_path)
    long_prompt = "for x in range(10): print(x)\n" * 8  # > 32 tokens, the training length
    rc, _, err = cli(capsys, "--workdir", dense, "--prompt", long_prompt, "--max-new-tokens", 4)
    assert rc == 2 and "takes at most 32 tokens" in err
    rc, _, err = cli(capsys, "--workdir", dense, "--prompt", "for x in", "--max-new-tokens", 40)
    assert rc == 2 and "exceeds this model's limit of 32" in err
    (tmp_path / "prompt.txt").write_text(long_prompt)
    rc, out, _ = cli(capsys, "--workdir", dense, "--prompt-file", tmp_path / "prompt.txt", "--max-new-tokens", 4, "--max-context", 512, "--greedy")
    assert rc == 0 and out.startswith(long_prompt)
    offset_cfg = run_lib.load(run_dir).cfg
    assert run_lib.context_limit(offset_cfg) is None and run_lib.context_limit(offset_cfg, 100) == 100  # offset models: no limit


def test_sample_refuses_a_checkpoint_without_its_tokenizer(run_dir, capsys, tmp_path):
    copy = variant(run_dir, tmp_path)
    (copy / "data" / "tokenizer.model").unlink()
    rc, _, err = cli(capsys, "--workdir", copy, "--prompt", "x")
    assert rc == 2 and "has no tokenizer" in err and "tokenizer.model is missing" in err
    elsewhere = variant(run_dir, tmp_path / "b", lambda c: c["data"].update(path=str(tmp_path / "gone")))
    rc, _, err = cli(capsys, "--workdir", elsewhere, "--prompt", "x")
    assert rc == 2 and "has no tokenizer" in err


@pytest.mark.parametrize("block_size, num_blocks, capacity, prompt", first_fast([(8, 3, 72, 20), (8, 100, 40, 7), (16, 2, 64, 16)], keep=2, unpack=True))
def test_block_sparse_cached_logits_equal_the_full_forward(block_size, num_blocks, capacity, prompt):
    """MoBA layers decode from a full cache plus one key sum per completed block; the cached logits
    equal a full forward under the same block-sparse attention (a budget past the blocks = dense)."""
    cfg = tiny(2, kind="block_sparse", block_size=block_size, num_blocks=num_blocks)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, capacity), 0, cfg.vocab_size)
    cached, full, decoder = cached_and_full(model, tokens, prompt)
    np.testing.assert_allclose(cached, full, atol=TOL["float32"])
    assert decoder.plans[0].kind.name == "block_sparse" and decoder.traces["step"] == 1
    cache = decoder.init_cache(2)
    assert cache[0].ksum.shape == (2, cfg.num_kv_heads, -(-capacity // block_size), cfg.resolved_head_dim)


def _randomise_nsa(model, key):
    """Gates and compressions away from their initial values (gates 1/2, compression = mean), so
    every learned part of NSA shows in the logits."""
    for block in model.blocks:
        nsa = block.attn.nsa
        for var in (nsa.gate.kernel, nsa.k_compress.pos, nsa.k_compress.w_out, nsa.v_compress.pos, nsa.v_compress.w_out):
            key, sub = jax.random.split(key)
            var[...] = 0.5 * jax.random.normal(sub, var[...].shape, var[...].dtype)
    return model


@pytest.mark.parametrize(
    "attention, capacity, prompt",
    first_fast(
        [
            (dict(kind="nsa", block_size=8, num_blocks=3, window=3), 72, 20),
            (dict(kind="nsa", block_size=4, num_blocks=2, window=0), 40, 3),  # a prompt shorter than a block; window = the own key
            (dict(kind="nsa", block_size=8, num_blocks=100, window=5), 40, 8),  # every earlier block selected
            (dict(kind="block_sparse", block_size=8, num_blocks=3, block_rank="nsa_prob"), 72, 20),
        ],
        keep=2,
        unpack=True,
    ),
)
def test_nsa_cached_logits_equal_the_full_forward(attention, capacity, prompt):
    """NSA layers decode from a full cache plus each completed block's compressed key and value
    (compressed in the step that completes the block), and MoBA layers rank by NSA's rule too:
    the cached logits equal a full forward under the same attention (fp32, 1e-4)."""
    cfg = tiny(2, **attention)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    if attention["kind"] == "nsa":
        _randomise_nsa(model, jax.random.PRNGKey(5))
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, capacity), 0, cfg.vocab_size)
    cached, full, decoder = cached_and_full(model, tokens, prompt)
    np.testing.assert_allclose(cached, full, atol=TOL["float32"], rtol=0)
    assert decoder.plans[0].kind.name == attention["kind"] and decoder.traces["step"] == 1
    if attention["kind"] == "nsa":
        cache = decoder.init_cache(2)
        assert cache[0].kcmp.shape == cache[0].vcmp.shape == (2, cfg.num_kv_heads, -(-capacity // attention["block_size"]), cfg.resolved_head_dim)


@pytest.mark.parametrize("capacity, prompt", first_fast([(6, 2), (13, 3)], unpack=True))
def test_block_layers_decode_a_capacity_of_part_of_a_block(capacity, prompt):
    """A capacity that is not whole blocks (launch.sample's is prompt + new tokens), below one
    block too: MoBA and NSA layers slice whole blocks of the cache, so it holds whole blocks."""
    for attention in (dict(kind="block_sparse", block_size=8, num_blocks=2), dict(kind="nsa", block_size=8, num_blocks=2, window=3)):
        cfg = tiny(2, **attention)
        model = Transformer(cfg, rngs=nnx.Rngs(3))
        tokens = jax.random.randint(jax.random.PRNGKey(7), (2, capacity), 0, cfg.vocab_size)
        cached, full, decoder = cached_and_full(model, tokens, prompt)
        np.testing.assert_allclose(cached, full, atol=TOL["float32"], rtol=0)
        assert decoder.plans[0].rows == (16 if capacity > 8 else 8)


def test_decoder_checks_its_capacity():
    decoder = Decoder(Transformer(tiny(1, kind="dense"), rngs=nnx.Rngs(0)), max_len=8)
    with pytest.raises(ValueError, match="exceeds"):
        list(decoder.generate(np.zeros((1, 5), np.int32), 4))
    with pytest.raises(ValueError, match="max_len"):
        decoder.prefill(np.zeros((1, 9), np.int32))
    with pytest.raises(ValueError, match="capacity"):
        decoder.step(decoder.init_cache(), np.zeros((1,), np.int32), 8)
    assert dataclasses.replace(GREEDY, vocab_size=5).greedy
