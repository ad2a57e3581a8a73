"""Passkey retrieval: prompt construction, scoring with oracle and random models, outputs, CLI."""

import csv
import json
import re

import numpy as np
import pytest
from flax import nnx

from fibjax import data as data_lib
from fibjax.config import ModelConfig, TrainConfig, apply_overrides
from fibjax.eval import passkey
from fibjax.eval.perplexity import EvalError
from fibjax.model import Transformer
from launch import passkey as passkey_cli
from tests.helpers import TINY


@pytest.fixture(scope="module")
def tok():
    texts = [*passkey.FILLER, passkey.QUESTION, *(passkey.NEEDLE.format(key=str(10_000 + 7919 * i % 90_000)) for i in range(30))]
    return data_lib.train_tokenizer(texts, 300)


def retrieval_oracle(tokenizer, fail_below_depth=None):
    """A "model" that reads the key from the needle in its input and answers it (teacher
    forcing: the argmax at position j is the next token; at the end, the answer's last token).
    With ``fail_below_depth``, it answers wrongly when the needle sits earlier than that."""

    def predict(params, tokens_NL):
        out = np.roll(tokens_NL, -1, axis=1)
        for row, tokens in zip(out, tokens_NL):
            text = tokenizer.decode(tokens)
            needle = re.search(r"The pass key is (\d{5})\. Remember it\. \d{5} is the pass key\.", text)
            row[-1] = passkey._answer_tokens(tokenizer, needle.group(1))[1][-1]
            before, after = needle.start(), text.rfind(passkey.QUESTION) - needle.end()  # filler characters
            if fail_below_depth is not None and before / (before + after) < fail_below_depth:
                row[-1] = (row[-1] + 1) % tokenizer.vocab_size
        return out

    return predict


@pytest.mark.parametrize("length, phase", [(82, 0), (100, 3), (257, 0), (257, 4)])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_prompt_has_exact_length_and_the_key_at_the_depth(tok, length, phase, depth):
    p = passkey.build_prompt(tok, length, depth, "48213", phase)
    needle = tok.encode(passkey.NEEDLE.format(key="48213"))
    question, answer = passkey._answer_tokens(tok, "48213")
    assert len(p.tokens) == length + 1 and p.tokens.dtype == np.int32
    assert list(p.tokens[p.needle_start : p.needle_start + len(needle)]) == needle
    assert p.haystack == length + 1 - len(needle) - len(question) - len(answer)
    assert abs(p.needle_start - depth * p.haystack) <= max(len(tok.encode(s)) for s in passkey.FILLER)
    assert list(p.tokens[p.answer_start :]) == answer and tok.decode(answer).strip() == "48213"
    text = tok.decode(p.tokens)
    assert text.endswith(f"{passkey.QUESTION} 48213") and text.count("48213") == 3
    before_question = text[: -len(f" {passkey.QUESTION} 48213")]
    assert p.needle_start == p.haystack or before_question.endswith(passkey.FILLER[-1 - phase])
    # from the first whole sentence on, the tokens are exactly how the joined text encodes
    first = passkey.build_prompt(tok, length, 0.0, "48213", phase).needle_start
    assert tok.encode(tok.decode(p.tokens[first:])) == list(p.tokens[first:])
    if depth == 1.0:
        assert p.needle_start == p.haystack and p.depth == 1.0


def test_prompt_errors_and_keys(tok):
    with pytest.raises(EvalError, match="alone take 81 tokens"):
        passkey.build_prompt(tok, 80, 0.5, "12345")
    with pytest.raises(EvalError, match="depth"):
        passkey.build_prompt(tok, 64, 1.5, "12345")
    trials = [passkey.random_trial(0, 64, d, i) for d in (0.0, 0.5) for i in range(20)]
    assert len({k for k, _ in trials}) == 40 and all(len(k) == 5 and k.isdigit() for k, _ in trials)
    assert {phase for _, phase in trials} == set(range(len(passkey.FILLER)))
    assert passkey.random_trial(3, 64, 0.5, 1) == passkey.random_trial(3, 64, 0.5, 1)


def test_oracle_scores_one_and_random_scores_zero(tok):
    grid = dict(lengths=[160, 257], depths=[0.0, 0.5, 1.0], trials=4, seed=1)
    perfect = passkey.passkey_grid(None, None, tok, **grid, predict_fn=retrieval_oracle(tok))
    assert perfect["mean_accuracy"] == 1.0 and np.all(np.asarray(perfect["token_accuracy"]) == 1.0)
    assert all(c["answers"] == [f" {k}" for k in c["keys"]] or [a.strip() for a in c["answers"]] == c["keys"] for c in perfect["cells"])
    rng = np.random.default_rng(0)
    noise = passkey.passkey_grid(None, None, tok, **grid, batch_size=3, predict_fn=lambda params, t: rng.integers(0, tok.vocab_size, t.shape))
    assert noise["mean_accuracy"] == 0.0 and np.mean(noise["token_accuracy"]) < 0.1
    # the grid is depth x length: an oracle blind to early needles fails exactly the depth-0 row
    half = passkey.passkey_grid(None, None, tok, **grid, predict_fn=retrieval_oracle(tok, fail_below_depth=0.25))
    assert half["accuracy"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]] and half["correct"][1] == [4, 4]


@pytest.mark.parametrize("attention", [dict(kind="dense"), dict(kind="offset", window=3, alpha="staggered")])
def test_runs_on_fibjax_models(tok, attention):
    """On a fibjax model (the jitted path every evaluation takes, 3 trials in batches of 2, so
    one padded), every cell's keys, answers, exact matches and token accuracy are those computed
    here from the model's own forward: argmax at each answer position against the answer."""
    import jax.numpy as jnp

    from fibjax.config import AttentionConfig

    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, attention=AttentionConfig(**attention))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    result = passkey.passkey_grid(cfg, nnx.state(model, nnx.Param), tok, [100, 128], [0.0, 1.0], trials=3, seed=0, batch_size=2)
    assert [(c["length"], c["depth"]) for c in result["cells"]] == [(100, 0.0), (100, 1.0), (128, 0.0), (128, 1.0)]
    for cell in result["cells"]:
        prompts = [passkey.build_prompt(tok, cell["length"], cell["depth"], *passkey.random_trial(0, cell["length"], cell["depth"], i)) for i in range(3)]
        predicted = np.asarray(jnp.argmax(model(jnp.asarray(np.stack([p.tokens[:-1] for p in prompts]))), axis=-1))
        answers = [pred[p.answer_start - 1 : len(p.tokens) - 1] for p, pred in zip(prompts, predicted)]
        hits = [answer == p.tokens[p.answer_start :] for answer, p in zip(answers, prompts)]
        assert cell["keys"] == [p.key for p in prompts] and cell["answers"] == [tok.decode(answer) for answer in answers]
        assert cell["correct"] == sum(h.all() for h in hits) and cell["token_accuracy"] == pytest.approx(np.mean([h.mean() for h in hits]))


def test_outputs_are_written(tok, tmp_path):
    result = passkey.passkey_grid(None, None, tok, [160, 257, 400], [0.0, 0.5, 1.0], trials=4, seed=2, predict_fn=retrieval_oracle(tok, fail_below_depth=0.25))
    paths = passkey.write_passkey_outputs({**result, "title": "oracle"}, tmp_path / "out")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == 9 and {int(r["length"]) for r in rows} == {160, 257, 400}
    assert sum(int(r["correct"]) for r in rows) == 24 and all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    assert json.loads(paths["json"].read_text())["accuracy"] == result["accuracy"]
    md = paths["md"].read_text()
    assert md.startswith("oracle") and "| depth \\ length | 160 | 257 | 400 |" in md and "| 0% | 0 | 0 | 0 |" in md


def test_cli_on_a_trained_run(tmp_path):
    from fibjax.train.loop import train

    data = tmp_path / "data"
    data_lib.prepare_default(data, vocab_size=384)
    cfg = apply_overrides(TrainConfig(), [*TINY, "steps=2", f"data.path={data}", "name=pk"])
    train(cfg, tmp_path / "run", progress=False)
    out = tmp_path / "pk"
    assert passkey_cli.main(["--workdir", str(tmp_path / "run"), "--lengths", "128,160", "--depths", "0,1", "--trials", "2", "--out", str(out)]) == 0
    saved = json.loads((out / "passkey.json").read_text())
    assert saved["run"] == "pk" and saved["step"] == 2 and saved["lengths"] == [128, 160] and (out / "passkey.png").exists()
    assert passkey_cli.main(["--workdir", str(tmp_path / "run"), "--step", "7"]) == 2


def test_an_eight_device_mesh_gives_the_answers_of_one_device(tok):
    """Prompts split over data x fsdp = 8 shards (5 trials padded to a batch of 8) predict what
    one device predicts, token for token."""
    import jax

    from fibjax.config import MeshConfig
    from fibjax.sharding import make_mesh

    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1)
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    grid = dict(lengths=[100], depths=[0.0, 1.0], trials=5, seed=1, batch_size=3)
    one = passkey.passkey_grid(cfg, params, tok, **grid)
    eight = passkey.passkey_grid(cfg, params, tok, **grid, mesh=make_mesh(MeshConfig(data=4, fsdp=2, tensor=1), jax.devices()[:8]))
    assert [c["answers"] for c in eight["cells"]] == [c["answers"] for c in one["cells"]]
    assert eight["token_accuracy"] == one["token_accuracy"]


@pytest.mark.parametrize("distance", [0, 9, 40, 150])
def test_a_needle_placed_by_distance_sits_that_far_before_the_question(tok, distance):
    sentence = max(len(tok.encode(s)) for s in passkey.FILLER)
    for phase in range(len(passkey.FILLER)):
        p = passkey.build_prompt(tok, 257, 0.3, "48213", phase, distance=distance)
        needle = tok.encode(passkey.NEEDLE.format(key="48213"))
        assert len(p.tokens) == 258 and list(p.tokens[p.needle_start : p.needle_start + len(needle)]) == needle
        assert abs(p.distance - distance) <= sentence // 2 + 1  # the nearest sentence start
        # the filler after the needle is exactly p.distance tokens, then the question
        question, answer = passkey._answer_tokens(tok, "48213")
        assert p.needle_start + len(needle) + p.distance + len(question) == p.answer_start
    with pytest.raises(EvalError, match="does not fit in a prompt of 100 tokens"):
        passkey.build_prompt(tok, 100, 0.0, "48213", distance=500)


def test_a_distance_grid_leaves_out_what_does_not_fit_and_the_oracle_reads_every_cell(tok):
    result = passkey.passkey_grid(None, None, tok, [100, 257], [], trials=3, seed=1, distances=[10, 150], predict_fn=retrieval_oracle(tok))
    assert result["placed_by"] == "distance" and result["distances"] == [10, 150]
    assert result["accuracy"] == [[1.0, 1.0], [None, 1.0]]  # 150 filler tokens do not fit in 100
    md = passkey.format_markdown(result)
    assert "| distance (tokens) \\ length | 100 | 257 |" in md and "| 150 | - | 100 |" in md
    # draws keyed by distance, not by depth: the same cell gives the same keys, another cell others
    keys = {(c["length"], c["distance"]): c["keys"] for c in result["cells"]}
    assert keys[(257, 10)] != keys[(257, 150)]
    again = passkey.passkey_grid(None, None, tok, [257], [], trials=3, seed=1, distances=[150], predict_fn=retrieval_oracle(tok))
    assert again["cells"][0]["keys"] == keys[(257, 150)]
    with pytest.raises(EvalError, match="no distance of"):
        passkey.passkey_grid(None, None, tok, [100], [], trials=1, distances=[500], predict_fn=retrieval_oracle(tok))
    with pytest.raises(EvalError, match="too short"):  # a length too short for the needle is an error, not an empty cell
        passkey.passkey_grid(None, None, tok, [20, 257], [], trials=1, distances=[10], predict_fn=retrieval_oracle(tok))


def test_training_documents_hold_one_needle_and_end_on_its_key(tmp_path):
    docs = passkey.training_documents(50, seed=3)
    assert docs == passkey.training_documents(50, seed=3) and docs != passkey.training_documents(50, seed=4)
    for doc in docs:
        key = re.search(r"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.", doc).group(1)
        assert doc.endswith(f"{passkey.QUESTION} {key}.") and doc.count(key) == 3
        assert 8 <= sum(doc.count(s) for s in passkey.FILLER) <= 60
    out = tmp_path / "docs.jsonl"
    assert passkey_cli.main(["--write-documents", str(out), "--documents", "7"]) == 0
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == passkey.training_documents(7, seed=0)
    assert passkey_cli.main(["--write-documents", str(tmp_path / "missing" / "d.jsonl")]) == 2


def test_compare_sets_models_side_by_side_and_refuses_grids_of_other_prompts(tok, tmp_path, capsys):
    """Two models' distance grids (the oracle, and the oracle failing near the start) in one table per
    length; a grid of another seed is refused by name; --compare from the command line."""
    grid = dict(tokenizer=tok, lengths=[100, 257], depths=[], trials=4, seed=1, distances=[10, 150])
    good = passkey.passkey_grid(None, None, predict_fn=retrieval_oracle(tok), **grid)
    bad = passkey.passkey_grid(None, None, predict_fn=retrieval_oracle(tok, fail_below_depth=0.9), **grid)
    md = passkey.compare_markdown({"oracle": good, "late": bad})
    assert "At 257 tokens:" in md and "| model | 10 | 150 | mean |" in md
    assert "| oracle | 100 / 100 | - | 100 / 100 |" in md  # at 100 tokens 150 filler tokens do not fit
    (a10, a150), (t10, t150) = ([row[1] for row in bad[k]] for k in ("accuracy", "token_accuracy"))
    assert a150 < 1.0  # the failing oracle fails somewhere, so the row below is not the good one's
    cells = f"{100 * a10:.0f} / {100 * t10:.0f} | {100 * a150:.0f} / {100 * t150:.0f} | {50 * (a10 + a150):.0f} / {50 * (t10 + t150):.0f}"
    assert f"| late | {cells} |" in md.split("At 257 tokens:")[1]
    other = passkey.passkey_grid(None, None, predict_fn=retrieval_oracle(tok), **{**grid, "seed": 2})
    with pytest.raises(EvalError, match="other and oracle were not drawn with the same prompts: they differ in seed"):
        passkey.compare_markdown({"oracle": good, "other": other})
    with pytest.raises(EvalError, match="nothing to compare"):
        passkey.compare_markdown({})
    for name, result in (("oracle", good), ("late", bad)):
        passkey.write_passkey_outputs({**result, "title": name}, tmp_path / name)
    out = tmp_path / "compare.md"
    assert passkey_cli.main(["--compare", str(tmp_path / "oracle"), str(tmp_path / "late"), "--out", str(out)]) == 0
    assert out.read_text().strip() == md.strip() and "| late |" in capsys.readouterr().out
    assert passkey_cli.main(["--compare", str(tmp_path / "nowhere")]) == 2
    assert "no passkey.json there" in capsys.readouterr().err
    passkey.write_passkey_outputs({**bad, "title": "late"}, tmp_path / "again" / "late")
    assert passkey_cli.main(["--compare", str(tmp_path / "late"), str(tmp_path / "again" / "late")]) == 2
    assert "two folders named 'late'" in capsys.readouterr().err
