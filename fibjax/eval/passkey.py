"""Passkey retrieval (needle in a haystack): accuracy over context lengths x needle depths.

A prompt of exactly ``length`` tokens (the model's input) is neutral filler sentences with a
needle planted at a chosen depth, then the question; the answer is the key::

    ...The sun is yellow. The pass key is 48213. Remember it. 48213 is the pass key. Here we go.
    ... What is the pass key? The pass key is| 48213

Scoring is teacher-forced: one forward pass over prompt + answer, and a trial counts iff the
argmax at every answer position is the answer's next token. For a causal model that is exactly
"greedy decoding reproduces the key's tokens" (step j of greedy decoding sees prompt +
answer[:j] iff steps 0..j-1 were right), at the cost of one forward instead of one per token.
Built at the token level, so lengths are exact; every piece is a whole number of SentencePiece
tokens that start with a word boundary, so the concatenation is how the joined text encodes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from fibjax.eval.perplexity import EvalError

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

PredictFn = Callable[[object, np.ndarray], np.ndarray]  # (params, tokens [N, L]) -> argmax ids [N, L]


@dataclass
class Prompt:
    tokens: np.ndarray  # [length + 1] int32: input tokens[:-1], next-token targets tokens[1:]
    answer_start: int  # index in tokens of the first answer token (the rest are answer)
    needle_start: int  # filler tokens before the needle (its index in tokens after the document start, BOS or none)
    haystack: int  # filler tokens in the prompt (needle, question and answer excluded)
    key: str

    @property
    def depth(self) -> float:
        """Where the needle actually sits: filler tokens before it / all filler tokens."""
        return self.needle_start / self.haystack if self.haystack else 0.0


def random_trial(seed: int, length: int, depth: float, trial: int) -> tuple[str, int]:
    """(5-digit key, filler phase) of one trial: a function of the cell and trial only, not of
    the rest of the grid. The phase (which sentence comes last) varies the haystack too, so a
    cell does not hang on one arrangement of sentences around the needle."""
    rng = np.random.default_rng([seed, length, round(depth * 1_000_000), trial])
    return str(int(rng.integers(10_000, 100_000))), int(rng.integers(len(FILLER)))


def _answer_tokens(tokenizer, key: str) -> tuple[list[int], list[int]]:
    """(question tokens, answer tokens): the answer is what " <key>" adds to the question."""
    question = tokenizer.encode(QUESTION)
    full = tokenizer.encode(f"{QUESTION} {key}")
    common = next((i for i, (a, b) in enumerate(zip(question, full)) if a != b), len(question))
    return full[:common], full[common:]


def build_prompt(tokenizer, length: int, depth: float, key: str, phase: int = 0) -> Prompt:
    """The ``length``-token prompt (+ the answer's last token as the final target).

    The filler is the sentences cycled and cut at the *front* so that it ends on a sentence
    (``FILLER[-1 - phase]``);
    the needle goes in at the sentence start nearest to ``depth`` x filler tokens (0: the first
    whole sentence, 1: right before the question; equally near: the earlier one)."""
    if not 0.0 <= depth <= 1.0:
        raise EvalError(f"depth must lie in [0, 1], got {depth}")
    question, answer = _answer_tokens(tokenizer, key)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    start = tokenizer.document_start  # BOS where the source model begins its documents with it (an imported Llama's)
    haystack = length + 1 - len(start) - len(needle) - len(question) - len(answer)
    if haystack < 0:
        raise EvalError(f"length {length} is too short: the needle, question and answer alone take {length - haystack} tokens")
    units = [tokenizer.encode(s) for s in FILLER]
    stream, starts = [], []
    while len(stream) < haystack:  # backwards from the question, one whole sentence at a time
        unit = units[(-1 - phase - len(starts)) % len(units)]
        stream = unit + stream
        starts = [0] + [s + len(unit) for s in starts]
    cut = len(stream) - haystack
    filler = stream[cut:]
    boundaries = sorted({haystack, *(s - cut for s in starts if s >= cut)})  # never inside the cut first sentence
    at = min(boundaries, key=lambda b: (abs(b - depth * haystack), b))
    tokens = start + filler[:at] + needle + filler[at:] + question + answer
    return Prompt(np.asarray(tokens, np.int32), len(tokens) - len(answer), at, haystack, key)


def model_predict_fn(model_cfg) -> PredictFn:
    """Argmax next token at every position for a fibjax model config (any attention kind)."""
    from fibjax.eval import batching

    return batching.on_model(model_cfg, batching.argmax_next)


def score(prompts: Sequence[Prompt], predicted_NL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exact match [N] bool, fraction of answer tokens right [N]) from argmax predictions."""
    exact, frac = [], []
    for p, pred in zip(prompts, predicted_NL):
        hits = pred[p.answer_start - 1 : len(p.tokens) - 1] == p.tokens[p.answer_start :]
        exact.append(bool(hits.all()))
        frac.append(float(hits.mean()))
    return np.asarray(exact), np.asarray(frac)


def passkey_grid(
    model_cfg,
    params,
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
    *,
    batch_size: int | None = None,
    predict_fn: PredictFn | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Accuracy of every (length, depth) cell over ``trials`` seeded keys.

    ``batch_size`` prompts per forward (default: all trials of a cell; one compile per
    length; rounded up to a multiple of the mesh's data shards); ``predict_fn`` replaces the
    model (tests); ``mesh``: prompts split over its data axes, parameters replicated. Returns a JSON-ready dict: the grid
    ``accuracy[depth][length]``, ``correct`` and ``token_accuracy``, and per-cell rows in ``cells``."""
    if trials < 1 or not lengths or not depths:
        raise EvalError(f"need trials >= 1 and at least one length and depth; got {trials}, {list(lengths)}, {list(depths)}")
    from fibjax.eval import batching

    predict = predict_fn or model_predict_fn(model_cfg)
    rows = batching.fixed_batch_size(batch_size or trials, mesh)
    params = batching.replicate(params, mesh)
    cells = []
    for length in lengths:
        for depth in depths:
            prompts = [build_prompt(tokenizer, length, depth, *random_trial(seed, length, depth, i)) for i in range(trials)]
            tokens = np.stack([p.tokens[:-1] for p in prompts])
            predicted = batching.in_fixed_batches(predict, params, tokens, rows, mesh)
            exact, frac = score(prompts, predicted)
            cells.append(
                {
                    "length": int(length),
                    "depth": float(depth),
                    "actual_depth": float(np.mean([p.depth for p in prompts])),
                    "trials": trials,
                    "correct": int(exact.sum()),
                    "accuracy": float(exact.mean()),
                    "token_accuracy": float(frac.mean()),
                    "keys": [p.key for p in prompts],
                    "answers": [tokenizer.decode(pred[p.answer_start - 1 : len(p.tokens) - 1]) for p, pred in zip(prompts, predicted)],
                }
            )
    grid = {(c["length"], c["depth"]): c for c in cells}
    return {
        "lengths": [int(x) for x in lengths],
        "depths": [float(x) for x in depths],
        "trials": trials,
        "seed": seed,
        "scoring": "teacher-forced argmax over every answer token (= greedy decoding exact match)",
        "accuracy": [[grid[(int(n), float(d))]["accuracy"] for n in lengths] for d in depths],
        "correct": [[grid[(int(n), float(d))]["correct"] for n in lengths] for d in depths],
        "token_accuracy": [[grid[(int(n), float(d))]["token_accuracy"] for n in lengths] for d in depths],
        "mean_accuracy": float(np.mean([c["accuracy"] for c in cells])),
        "cells": cells,
        "devices": batching.mesh_devices(mesh),
    }


# --- outputs ------------------------------------------------------------------------------


def format_markdown(result: dict) -> str:
    """Accuracy (%) with depths as rows and lengths as columns, and a mean row."""
    title = result.get("title", "Passkey retrieval")
    head = "| depth \\ length | " + " | ".join(str(n) for n in result["lengths"]) + " |"
    lines = [
        title,
        "",
        f"Exact-match accuracy (%), {result['trials']} trials per cell, seed {result['seed']}.",
        "",
        head,
        "|---|" + "---:|" * len(result["lengths"]),
    ]
    for d, row in zip(result["depths"], result["accuracy"]):
        lines.append(f"| {100 * d:.0f}% | " + " | ".join(f"{100 * a:.0f}" for a in row) + " |")
    means = np.mean(np.asarray(result["accuracy"]), axis=0)
    lines.append("| mean | " + " | ".join(f"{100 * a:.0f}" for a in means) + " |")
    return "\n".join(lines)


def write_csv(result: dict, path: Path) -> None:
    fields = ["length", "depth", "actual_depth", "trials", "correct", "accuracy", "token_accuracy"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["cells"])


def plot_heatmap(result: dict, path: Path) -> None:
    """Depth (rows, 0% at the top) x length (columns), red 0 -> green 1, every cell labelled."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    from fibjax.eval.plots import fit_titles

    acc = np.asarray(result["accuracy"], float)
    n_depths, n_lengths = acc.shape
    fig = Figure(figsize=(1.6 + 1.1 * n_lengths, 1.4 + 0.55 * n_depths), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(n_lengths), [str(n) for n in result["lengths"]])
    ax.set_yticks(range(n_depths), [f"{100 * d:.0f}%" for d in result["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (0% = start)")
    ax.set_xticks(np.arange(-0.5, n_lengths), minor=True)
    ax.set_yticks(np.arange(-0.5, n_depths), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    for (i, j), a in np.ndenumerate(acc):
        ax.text(
            j,
            i,
            f"{100 * a:.0f}%\n{result['correct'][i][j]}/{result['trials']}",
            ha="center",
            va="center",
            fontsize=8,
            color="white" if a < 0.25 or a > 0.85 else "black",
        )
    fig.colorbar(image, ax=ax, label="exact-match accuracy", format=lambda x, _: f"{100 * x:.0f}%")
    ax.set_title(f"{result.get('title', 'Passkey retrieval')}\nmean {100 * result['mean_accuracy']:.0f}%, {result['trials']} trials per cell", fontsize=10)
    fit_titles(fig)  # the title names the run and the attention: wider than a small grid
    fig.savefig(path, dpi=130)


def write_passkey_outputs(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """passkey.json (everything), passkey.csv (one row per cell), passkey.md, passkey.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"passkey.{ext}" for ext in ("json", "csv", "md", "png")}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    write_csv(result, paths["csv"])
    paths["md"].write_text(format_markdown(result) + "\n")
    plot_heatmap(result, paths["png"])
    return paths
