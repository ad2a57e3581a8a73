"""fibjax runs in EleutherAI's lm-evaluation-harness (``fibjax.eval.harness``; the ``harness`` extra).

Every number the harness model returns is checked against the model run directly, unpadded, one
request at a time (greedy generation too, against full forwards without a cache); rolling
loglikelihood against launch.eval's perplexity on the same tokens; and local tasks on held-out
sentences of the embedded corpus (a multiple-choice cloze, a generation) run offline through
lm-eval's Python API and its command line.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from fibjax.data.prepare import EMBEDDED_VAL_FRACTION  # noqa: E402
from fibjax.data.sources import embedded_documents, is_held_out  # noqa: E402
from fibjax.eval import harness  # noqa: E402
from fibjax.eval.perplexity import evaluate_lengths  # noqa: E402
from tests.helpers import ROOT, TINY  # noqa: E402
from tests.tiers import slow  # noqa: E402

# a continuation's loglikelihood (a few tokens, float32), batched and padded vs one unpadded row at
# a time: measured <= 6e-6
ATOL = 1e-4
# a text's summed NLL (~1.5k tokens): rolling vs evaluate_lengths's float32 mean x tokens, measured
# <= 1e-7 relative (the per-token NLLs come from the same windows and the same jitted function)
RTOL = 1e-5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir):
    from launch.train import main

    workdir = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["--workdir", str(workdir), "--no-progress", *TINY, f"data.path={data_dir}", "steps=150"]) == 0
    return workdir


@pytest.fixture(scope="module")
def lm(run_dir):
    return harness.FibjaxLM(workdir=str(run_dir), max_length=32)


def requests(kind, *args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


@pytest.fixture(scope="module")
def log_probs(lm):
    """Input ids -> [T, V] float64 next-token log-probabilities: one unpadded forward, no cache."""
    from flax import nnx

    from fibjax.model import graphdef_of

    model = nnx.merge(graphdef_of(lm.model_cfg), lm.params)
    forward = jax.jit(lambda tokens_1T: jax.nn.log_softmax(model(tokens_1T)[0]))
    return lambda row: np.asarray(forward(jnp.asarray([row], jnp.int32)), np.float64)


def direct_loglikelihood(lm, log_probs, context, continuation):
    """lm-eval's causal convention, computed by hand: encode whole, split at the context's tokens."""
    tok = lm.tok
    ctx = tok.encode(context) if context else [tok.eos_id]
    cont = tok.encode(context + continuation)[len(ctx) :] if context else tok.encode(continuation)
    row = (ctx + cont)[-(lm.max_length + 1) :]
    lp = log_probs(row[:-1])[-len(cont) :]
    return float(sum(lp[i, t] for i, t in enumerate(cont))), bool(all(lp[i].argmax() == t for i, t in enumerate(cont)))


def held_out_sentences(min_words=6):
    """Plain-English sentences (words of letters, commas at most) of the embedded corpus's validation documents."""
    out = []
    for doc in embedded_documents():
        if is_held_out(doc, EMBEDDED_VAL_FRACTION):
            for s in re.split(r"(?<=\.)\s+", " ".join(doc.split())):
                words = s.rstrip(".").split(" ")
                if len(words) >= min_words and all(re.fullmatch(r"[A-Za-z]+,?", w) for w in words) and words[-1].isalpha():
                    out.append(words)
    return out


def test_loglikelihood_equals_the_model_run_directly(lm, log_probs):
    sentence = " ".join(held_out_sentences()[0][:5])
    long_context = " ".join(" ".join(w) for w in held_out_sentences()[1:6])  # past max_length: cut from the left
    pairs = [(sentence[:20], sentence[20:]), ("", sentence), (long_context, " the end"), ("The value is", " None")]
    assert len(lm.tok.encode(long_context)) > lm.max_length
    got = lm.loglikelihood(requests("loglikelihood", *pairs))
    for pair, (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = direct_loglikelihood(lm, log_probs, *pair)
        assert abs(ll - want_ll) < ATOL and greedy == want_greedy, (pair, ll, want_ll)


def greedy_by_full_forwards(lm, log_probs, prompt, new_tokens):
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(log_probs(ids)[-1, : lm.tok.vocab_size].argmax()))
        if ids[-1] == lm.tok.eos_id:
            ids.pop()
            break
    return lm.tok.decode(ids)[len(lm.tok.decode(prompt)) :]


@slow
def test_generate_until_is_greedy_and_stops(lm, log_probs):
    short = " ".join(held_out_sentences()[0][:4])
    long = " ".join(" ".join(w) for w in held_out_sentences()[1:3])
    assert 16 < len(lm.tok.encode(short)) <= lm.max_length - 8 < len(lm.tok.encode(long))
    free = lm.generate_until(requests("generate_until", (short, {"until": [], "max_gen_toks": 8}), (long, {"max_gen_toks": 8})))
    # the cached decoder (a power-of-two prefill, the rest of the prompt a token a step) as full
    # forwards; a long context keeps its last max_length - max_gen_toks tokens
    assert free[0] == greedy_by_full_forwards(lm, log_probs, lm.tok.encode(short), 8) and len(free[0].strip()) >= 4
    assert free[1] == greedy_by_full_forwards(lm, log_probs, lm.tok.encode(long)[-(lm.max_length - 8) :], 8)
    # the text stops before the first stop string (the earliest of several)
    stops = [free[0][3:5], free[0][1:3]]
    [cut] = lm.generate_until(requests("generate_until", (short, {"until": stops, "max_gen_toks": 8})))
    assert cut == free[0][: min(free[0].find(s) for s in stops)]


def test_loglikelihood_rolling_equals_perplexity(lm, log_probs):
    words = " ".join(" ".join(w) for w in held_out_sentences()[:30]).split(" ")
    while len(lm.tok.encode(" ".join(words))) % lm.max_length:  # a whole number of windows
        words.pop()
    text = " ".join(words)
    ids = lm.tok.encode(text)
    [rolling] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
    [row] = evaluate_lengths(lm.model_cfg, lm.params, np.array([lm.tok.eos_id, *ids]), [lm.max_length], max_tokens=len(ids), rows_tokens=lm.rows_tokens)
    assert row.tokens == len(ids) >= 4 * lm.max_length
    assert rolling == pytest.approx(-row.nll * row.tokens, rel=RTOL)
    # a last, shorter window is scored from its own start like the others (padding reaches nothing)
    tail = " and more words"
    [longer] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text + tail,)))
    stream = [lm.tok.eos_id, *lm.tok.encode(text + tail)]
    want = sum(
        -log_probs(w[:-1])[np.arange(len(w) - 1), w[1:]].sum() for w in (stream[s : s + lm.max_length + 1] for s in range(0, len(stream) - 1, lm.max_length))
    )
    assert longer == pytest.approx(-want, rel=RTOL)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    """Two local tasks on the held-out sentences of the embedded corpus, each without its last
    word: fibjax_cloze, the right word vs three last words of other sentences (the right one at
    a rotating position); fibjax_complete, greedy generation of the rest, scored by exact match."""
    out = tmp_path_factory.mktemp("tasks")
    sentences = held_out_sentences()[:24]
    assert len(sentences) >= 12
    lines = []
    for i, words in enumerate(sentences):
        others = [w[-1] for w in sentences[i + 1 :] + sentences[:i] if w[-1] != words[-1]]
        choices = list(dict.fromkeys(others))[:3]
        choices.insert(i % 4, words[-1])
        lines.append(json.dumps({"context": " ".join(words[:-1]), "choices": choices, "label": i % 4}))
    (out / "cloze.jsonl").write_text("\n".join(lines) + "\n")
    data = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / "cloze.jsonl"}
  cache_dir: {out / "hf_cache"}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
    (out / "fibjax_cloze.yaml").write_text(f"""task: fibjax_cloze
{data}output_type: multiple_choice
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (out / "fibjax_complete.yaml").write_text(f"""task: fibjax_complete
{data}output_type: generate_until
doc_to_target: " {{{{choices[label]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return out


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def api_result(run_dir, local_tasks):
    """``lm_eval.simple_evaluate`` on the local tasks, offline."""
    import datasets.config

    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read when datasets is imported, maybe earlier
        return lm_eval.simple_evaluate(
            model="fibjax",
            model_args={"workdir": str(run_dir), "max_length": 32},
            tasks=["fibjax_cloze", "fibjax_complete"],
            task_manager=TaskManager(include_path=str(local_tasks), include_defaults=False),
            bootstrap_iters=0,
        )


def test_simple_evaluate_on_a_local_task(lm, log_probs, api_result, local_tasks):
    assert api_result["config"]["fibjax_step"] == 150
    # every choice's score is the model's own loglikelihood, and acc is the share the model gets
    # right by those (some but not all: a constant acc would fail)
    right = []
    for sample in api_result["samples"]["fibjax_cloze"]:
        got = [resp[0][0] for resp in sample["resps"]]
        want = [direct_loglikelihood(lm, log_probs, *args)[0] for args in sample["arguments"]]
        assert np.allclose(got, want, rtol=0, atol=ATOL)
        right.append(int(np.argmax(want)) == sample["target"])
    acc = api_result["results"]["fibjax_cloze"]["acc,none"]
    assert len(right) == len((local_tasks / "cloze.jsonl").read_text().splitlines()) and 0 < np.mean(right) < 1 and acc == pytest.approx(np.mean(right))
    # generation is greedy (full forwards here, no cache) within the task's budget of 6 tokens (the
    # context's last max_length - 6 tokens), cut before the stop string; exact match is the share
    # of generations equal to the target
    samples = api_result["samples"]["fibjax_complete"]
    generated = [sample["resps"][0][0] for sample in samples]
    want = [greedy_by_full_forwards(lm, log_probs, lm.tok.encode(s["arguments"][0][0])[-(lm.max_length - 6) :], 6).split(".")[0] for s in samples]
    assert len(generated) == len(right) and any(generated) and generated == want
    exact = np.mean([g == s["target"] for g, s in zip(generated, samples)])
    assert api_result["results"]["fibjax_complete"]["exact_match,none"] == pytest.approx(exact)


@slow
def test_command_line(run_dir, local_tasks, api_result, tmp_path):
    """``python -m fibjax.eval.harness`` takes lm-eval's command line with the model implied (and
    batch_size among the model_args), and scores the task as the Python API does."""
    cmd = [
        sys.executable,
        "-m",
        "fibjax.eval.harness",
        "--model_args",
        f"workdir={run_dir},max_length=32,batch_size=4",
        "--tasks",
        "fibjax_cloze",
        "--include_path",
        str(local_tasks),
        "--output_path",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fibjax_cloze" in proc.stdout and "acc" in proc.stdout, proc.stdout
    [written] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(written.read_text())["results"]["fibjax_cloze"]["acc,none"] == api_result["results"]["fibjax_cloze"]["acc,none"]


@slow  # 18 s: lm-eval indexes its tasks before it builds the model
def test_launch_harness_names_a_run_it_cannot_load_in_one_error_line(tmp_path, capsys):
    """A FibjaxError from loading the run is one ``error:`` line and exit 2, not a traceback."""
    from launch.harness import main

    rc = main(["--model_args", f"workdir={tmp_path / 'nowhere'}", "--tasks", "lambada_openai", "--limit", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {tmp_path / 'nowhere'} holds no fibjax run (config.json missing)" in err and "Traceback" not in err, err
