"""Hugging Face import and export (``fibjax.hf``, ``launch.import_hf``, ``launch.export_hf``).

Parity against the real thing: for each architecture (Llama, Llama 3 with rope_scaling llama3,
Mistral, Qwen2) a tiny random model built and saved by transformers itself is imported; fibjax's
logits equal transformers' within float32 tolerance on a ragged (right-padded) batch, 32 greedy
tokens of fibjax's cached decoder equal transformers' ``generate``, the export loads back into
transformers with equal logits, and import -> export -> import is the identity on parameters.
Those need the ``hf-parity`` extra (skipped with one line naming it otherwise). The checks of bad
input use model directories written without torch and run everywhere.
"""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fibjax.hf import UnsupportedModel, export_model, import_model, plan_import, safetensors
from fibjax.model import graphdef_of
from fibjax.run.load import load_run
from tests import hf_models
from tests.helpers import ROOT
from tests.tiers import first_fast

# float32 logits of |x| ~ 1-2 through two layers: transformers and fibjax differ by ~6e-7 (measured)
LOGIT_ATOL = 2e-5


def _model(run):
    return nnx.merge(graphdef_of(run.cfg.model), run.params)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}
    return {prefix: np.asarray(tree)}


# --- refused architectures and bad input: one line, nothing written ------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "max_window_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_an_architecture_fibjax_cannot_compute_is_refused_by_name(tmp_path, change, field):
    model_dir = hf_models.handmade(tmp_path / "model", **change)
    with pytest.raises(UnsupportedModel, match=field):
        import_model(model_dir, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _truncate(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    return "truncated"


def _lose_a_shard(model_dir):
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors is missing"


def _wrong_shape(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    return "gate_proj.weight' has shape"


def _no_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    return "tokenizer"


def _pickles_only(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    return "pickles, which fibjax never loads"


def _mixed_dtypes(model_dir):
    path = model_dir / "model.safetensors"
    refs = safetensors.read_header(path)
    arrays = {n: np.array(r.map()) for n, r in refs.items()}
    arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(np.float16)
    safetensors.write(path, [(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()])
    return "mixes dtypes"


@pytest.mark.parametrize("damage", [_truncate, _lose_a_shard, _wrong_shape, _no_tokenizer, _pickles_only, _mixed_dtypes], ids=lambda f: f.__name__[1:])
def test_bad_input_is_one_error_and_writes_nothing(tmp_path, damage):
    shards = 2 if damage is _lose_a_shard else 1
    model_dir = hf_models.handmade(tmp_path / "model", shards=shards)
    expected = damage(model_dir)
    with pytest.raises(UnsupportedModel, match=expected):
        import_model(model_dir, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_non_empty_workdir_is_refused_and_left_as_it_was(tmp_path):
    model_dir = hf_models.handmade(tmp_path / "model")
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("mine")
    with pytest.raises(UnsupportedModel, match="not empty"):
        import_model(model_dir, workdir)
    assert [p.name for p in workdir.iterdir()] == ["notes.txt"]


def test_the_command_line_refuses_with_one_line_and_exit_2(tmp_path):
    model_dir = hf_models.handmade(tmp_path / "model", model_type="mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    command = [sys.executable, "-m", "launch.import_hf", str(model_dir), "--workdir", str(tmp_path / "run")]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "layer_types mixes" in lines[0], out.stderr
    assert not (tmp_path / "run").exists()


# --- the round trip, without torch -------------------------------------------------------------


@pytest.mark.parametrize("model_type, tie, shards", first_fast([("llama", False, 2), ("qwen2", True, 1)], unpack=True))
def test_import_export_import_is_the_identity(tmp_path, model_type, tie, shards):
    model_dir = hf_models.handmade(tmp_path / "model", model_type=model_type, tie=tie, shards=shards)
    import_model(model_dir, tmp_path / "run")
    export_model(tmp_path / "run", tmp_path / "exported")
    import_model(tmp_path / "exported", tmp_path / "again")
    first, again = _flat(load_run(tmp_path / "run").params), _flat(load_run(tmp_path / "again").params)
    assert first.keys() == again.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], again[name], err_msg=name)
    source = {}
    for f in model_dir.glob("*.safetensors"):
        source.update({n: np.array(r.map()) for n, r in safetensors.read_header(f).items()})
    exported = {n: np.array(r.map()) for n, r in safetensors.read_header(tmp_path / "exported" / "model.safetensors").items()}
    assert exported.keys() == source.keys()
    for name, array in source.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


@pytest.mark.parametrize(
    "model_type, config, window",
    [
        ("mistral", {"sliding_window": 8}, 8),
        ("mistral", {"sliding_window": None}, None),
        ("mistral", {"sliding_window": 8, "layer_types": ["sliding_attention"] * 2}, 8),
        ("mistral", {"sliding_window": 8, "layer_types": ["full_attention"] * 2}, None),
        ("qwen2", {"sliding_window": 8, "use_sliding_window": False}, None),
        ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}, 8),
        ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, None),
        ("llama", {"sliding_window": 8}, None),
    ],
)
def test_a_sliding_window_in_every_layer_imports_onto_the_window_kind(tmp_path, model_type, config, window):
    """transformers slides Mistral whenever sliding_window is set, Qwen2 from max_window_layers on
    with use_sliding_window, Llama never; the window kind attends the same W keys (0 <= i - j < W).
    Logit parity with transformers' own sliding-window Mistral: test_logits_equal_transformers_*."""
    model_dir = hf_models.handmade(tmp_path / "model", model_type=model_type, **config)
    cfg = import_model(model_dir, tmp_path / "run")
    if window is None:
        assert cfg.model.attention.kind == "dense"
    else:
        assert (cfg.model.attention.kind, cfg.model.attention.window) == ("window", window)
        export_model(tmp_path / "run", tmp_path / "exported")  # transformers runs the window itself: no fibjax_attention
        exported = json.loads((tmp_path / "exported" / "config.json").read_text())
        assert exported["sliding_window"] == window and exported["use_sliding_window"] and "fibjax_attention" not in exported
        again = import_model(tmp_path / "exported", tmp_path / "again")
        assert again.model.attention == cfg.model.attention


def test_a_sliding_window_and_another_recorded_attention_are_refused(tmp_path):
    fib = {"kind": "offset", "window": 8}
    model_dir = hf_models.handmade(tmp_path / "model", model_type="mistral", sliding_window=8, fibjax_attention=fib)
    with pytest.raises(UnsupportedModel, match="name different attentions"):
        import_model(model_dir, tmp_path / "run")


def test_plan_import_reads_headers_only_and_maps_the_config(tmp_path):
    model_dir = hf_models.handmade(tmp_path / "model", model_type="qwen2", tie=True, rope_theta=1e6, rms_norm_eps=1e-6)
    hf, cfg, refs, tokenizer = plan_import(model_dir)
    m = cfg.model
    assert (m.qkv_bias, m.tie_embeddings, m.rope_theta, m.norm_eps, m.num_kv_heads, m.mlp_hidden) == (True, True, 1e6, 1e-6, 2, 96)
    assert cfg.seq_len == hf["max_position_embeddings"] and tokenizer.eos_id == 2


# --- parity against transformers (the hf-parity extra) ------------------------------------------


@pytest.fixture(params=first_fast(list(hf_models.ARCHS), keep=5))
def imported(request, tmp_path):
    """(arch, the transformers model, the fibjax run it was imported into)."""
    arch = request.param
    reference = hf_models.by_transformers(tmp_path / "model", arch)
    import_model(tmp_path / "model", tmp_path / "run")
    return arch, reference, load_run(tmp_path / "run"), tmp_path


def test_logits_equal_transformers_on_a_ragged_batch(imported):
    import torch

    _, reference, run, _ = imported
    rng = np.random.default_rng(1)
    lengths = [40, 23]
    tokens = np.zeros((2, max(lengths)), np.int64)
    mask = np.zeros_like(tokens)
    for row, n in enumerate(lengths):
        tokens[row, :n] = rng.integers(3, hf_models.VOCAB, n)
        mask[row, :n] = 1
    with torch.no_grad():
        expected = reference(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(_model(run)(jnp.asarray(tokens)))
    for row, n in enumerate(lengths):  # right padding: causal attention keeps each row's real positions apart from its pads
        np.testing.assert_allclose(got[row, :n], expected[row, :n], atol=LOGIT_ATOL, rtol=0)


def test_32_greedy_tokens_equal_transformers_generate(imported):
    import torch

    from fibjax.decode import Decoder
    from fibjax.decode.sampling import GREEDY

    _, reference, run, _ = imported
    prompt = np.random.default_rng(2).integers(3, hf_models.VOCAB, (1, 12))
    reference.generation_config.eos_token_id = None  # 32 tokens whatever comes
    with torch.no_grad():
        expected = reference.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 12:].numpy()
    decoder = Decoder(_model(run), max_len=12 + 32)
    got = np.array([int(t[0]) for t in decoder.generate(prompt, 32, sampler=GREEDY, seed=0)])
    np.testing.assert_array_equal(got, expected)


def test_the_export_loads_in_transformers_with_equal_logits(imported):
    import torch

    transformers = hf_models.transformers_or_skip()
    arch, reference, run, tmp_path = imported
    export_model(run.workdir, tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(reloaded) is type(reference)
    tokens = torch.tensor(np.random.default_rng(3).integers(3, hf_models.VOCAB, (2, 30)))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), reference(tokens).logits.numpy())


def test_the_harness_scores_an_imported_model_after_bos_as_lm_eval_does(tmp_path):
    """lm-eval's Hugging Face model begins every context with BOS when the tokenizer adds one;
    fibjax's harness model does the same for an imported model (and its empty context is BOS)."""
    pytest.importorskip("lm_eval", reason="needs the harness extra: pip install -e '.[harness]'")
    import jax
    from lm_eval.api.instance import Instance

    from fibjax.eval import harness

    import_model(hf_models.handmade(tmp_path / "model"), tmp_path / "run", seq_len=32)
    lm = harness.FibjaxLM(workdir=str(tmp_path / "run"), max_length=32)
    tok = lm.tok
    assert tok.add_bos and lm.prefix_token_id == tok.bos_id
    context, continuation = "The quick brown", " fox jumps"
    ((got, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    whole, ctx = [tok.bos_id, *tok.encode(context + continuation)], [tok.bos_id, *tok.encode(context)]
    log_probs = np.asarray(jax.nn.log_softmax(_model(load_run(tmp_path / "run"))(jnp.asarray([whole[:-1]]))[0]))
    expected = sum(log_probs[i - 1, whole[i]] for i in range(len(ctx), len(whole)))
    assert got == pytest.approx(expected, abs=1e-4)


def test_a_passkey_prompt_begins_with_bos_for_a_model_that_uses_it(tmp_path):
    from fibjax.data.tokenizer import load_tokenizer
    from fibjax.eval.passkey import build_prompt

    tok = load_tokenizer(hf_models.handmade(tmp_path / "model"))
    prompt = build_prompt(tok, 160, 0.5, "12345")
    assert prompt.tokens[0] == tok.bos_id and len(prompt.tokens) == 161


@pytest.mark.slow
def test_every_command_works_on_an_imported_model(tmp_path):
    """As the guide runs it: import, prepare text with the model's tokenizer, evaluate, sample,
    and continue it with Fibonacci attention through init_from; then export the result, and
    import it again as a Fibonacci model."""
    model_dir = hf_models.handmade(tmp_path / "model")
    text, val = tmp_path / "text.txt", tmp_path / "val.txt"
    text.write_text(" ".join(hf_models.synthetic.TOKENIZER_TEXT * 20))
    val.write_text(" ".join(reversed(hf_models.synthetic.TOKENIZER_TEXT * 4)))
    run, data, fib = tmp_path / "run", tmp_path / "data", tmp_path / "fib"

    def launch(*args):
        out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    assert "imported" in launch("launch.import_hf", str(model_dir), "--workdir", str(run), "--seq-len", "32")
    launch("launch.prepare_data", "--out", str(data), "--tokenizer", str(model_dir), "--source", f"text={text}", "--val", f"text={val}")
    assert "| text | 64 |" in launch("launch.eval", "--workdir", str(run), "--data", f"text={data}", "--lengths", "32,64")
    launch("launch.sample", "--workdir", str(run), "--prompt", "The quick", "--max-new-tokens", "4", "--greedy")
    train = ("launch.train", "--config", str(run / "config.json"), "--workdir", str(fib), "--no-progress")
    overrides = (f"init_from={run}", f"data.path={data}", "model.attention.kind=offset", "model.attention.alpha=staggered", "model.attention.window=4")
    launch(*train, *overrides, "steps=4", "global_batch=8", "checkpoint.every_steps=2", "eval.every_steps=0", "eval.max_tokens=1024")
    launch("launch.export_hf", "--workdir", str(fib), str(tmp_path / "exported"))
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["fibjax_attention"]["kind"] == "offset"
    assert "offset attention" in launch("launch.import_hf", str(tmp_path / "exported"), "--workdir", str(tmp_path / "fib-again"))
    assert load_run(tmp_path / "fib-again").cfg.model.attention == load_run(fib).cfg.model.attention
