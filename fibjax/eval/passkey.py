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

A needle is placed by **depth** (a fraction of the filler before it) or by **distance** (filler
tokens between the needle and the question): by distance, the question is what a bounded
attention (a window of W keys) can or cannot reach, whatever the prompt's length.
``training_documents`` writes the synthetic pass-key corpus a small model learns the task from.
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

    @property
    def distance(self) -> int:
        """Filler tokens between the needle's end and the question (the needle's last key sits
        about 5 tokens, the question ~10 tokens, further from the answer)."""
        return self.haystack - self.needle_start


class DistanceDoesNotFit(EvalError):
    """A needle distance longer than a prompt's filler: a grid leaves that cell empty."""


# A trial's random draws are keyed by where its needle goes: a depth in [0, 1] (scaled by 1e6) or
# a distance in tokens (offset so that the two never share a key).
DISTANCE_KEY = 10_000_000


def random_trial(seed: int, length: int, depth: float, trial: int, *, distance: int | None = None) -> tuple[str, int]:
    """(5-digit key, filler phase) of one trial: a function of the cell and trial only, not of
    the rest of the grid. The phase (which sentence comes last) varies the haystack too, so a
    cell does not hang on one arrangement of sentences around the needle. A cell placed by
    ``distance`` ignores ``depth``."""
    place = round(depth * 1_000_000) if distance is None else DISTANCE_KEY + distance
    rng = np.random.default_rng([seed, length, place, trial])
    return str(int(rng.integers(10_000, 100_000))), int(rng.integers(len(FILLER)))


def _answer_tokens(tokenizer, key: str) -> tuple[list[int], list[int]]:
    """(question tokens, answer tokens): the answer is what " <key>" adds to the question."""
    question = tokenizer.encode(QUESTION)
    full = tokenizer.encode(f"{QUESTION} {key}")
    common = next((i for i, (a, b) in enumerate(zip(question, full)) if a != b), len(question))
    return full[:common], full[common:]


def build_prompt(tokenizer, length: int, depth: float, key: str, phase: int = 0, *, distance: int | None = None) -> Prompt:
    """The ``length``-token prompt (+ the answer's last token as the final target).

    The filler is the sentences cycled and cut at the *front* so that it ends on a sentence
    (``FILLER[-1 - phase]``);
    the needle goes in at the sentence start nearest to ``depth`` x filler tokens (0: the first
    whole sentence, 1: right before the question; equally near: the earlier one), or, with
    ``distance``, nearest to ``distance`` filler tokens before the question (``depth`` ignored;
    sentences are a few tokens long, so the distance is met to within one sentence).

    Args:
        tokenizer: Encodes the filler, needle, question and answer.
        length: The prompt's tokens (the model's input).
        depth: Where the needle goes, 0 (start) to 1 (before the question); ignored with ``distance``.
        key: The pass key, five digits.
        phase: Which filler sentence comes last.
        distance: Filler tokens between the needle and the question (None: place by ``depth``).

    Returns:
        The prompt, its answer's position and where the needle sits.

    Raises:
        DistanceDoesNotFit: ``distance`` is longer than the prompt's filler.
        EvalError: ``depth`` outside [0, 1], a negative ``distance``, or a ``length`` too short
            for the needle, question and answer.
    """
    if distance is None and not 0.0 <= depth <= 1.0:
        raise EvalError(f"depth must lie in [0, 1], got {depth}")
    if distance is not None and distance < 0:
        raise EvalError(f"distance must be >= 0 tokens, got {distance}")
    question, answer = _answer_tokens(tokenizer, key)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    start = tokenizer.document_start  # BOS where the source model begins its documents with it (an imported Llama's)
    haystack = length + 1 - len(start) - len(needle) - len(question) - len(answer)
    if haystack < 0:
        raise EvalError(f"length {length} is too short: the needle, question and answer alone take {length - haystack} tokens")
    if distance is not None and distance > haystack:
        raise DistanceDoesNotFit(f"distance {distance} does not fit in a prompt of {length} tokens: it holds {haystack} filler tokens; pass a longer --lengths")
    units = [tokenizer.encode(s) for s in FILLER]
    stream, starts = [], []
    while len(stream) < haystack:  # backwards from the question, one whole sentence at a time
        unit = units[(-1 - phase - len(starts)) % len(units)]
        stream = unit + stream
        starts = [0] + [s + len(unit) for s in starts]
    cut = len(stream) - haystack
    filler = stream[cut:]
    boundaries = sorted({haystack, *(s - cut for s in starts if s >= cut)})  # never inside the cut first sentence
    target = depth * haystack if distance is None else haystack - distance
    at = min(boundaries, key=lambda b: (abs(b - target), b))
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
    distances: Sequence[int] | None = None,
    batch_size: int | None = None,
    predict_fn: PredictFn | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Accuracy of every (length, depth) cell over ``trials`` seeded keys; with ``distances``,
    of every (length, distance) cell instead (``depths`` ignored; a distance that does not fit
    in a length is left out of that column: None in the grid, "-" in the table).

    ``batch_size`` prompts per forward (default: all trials of a cell; one compile per
    length; rounded up to a multiple of the mesh's data shards); ``predict_fn`` replaces the
    model (tests); ``mesh``: prompts split over its data axes, parameters replicated. Returns a JSON-ready dict: the grid
    ``accuracy[row][length]`` (rows: ``depths`` or ``distances``, named by ``placed_by``),
    ``correct`` and ``token_accuracy``, and per-cell rows in ``cells``."""
    placed_by = "depth" if distances is None else "distance"
    rows_ = list(depths) if distances is None else [int(d) for d in distances]
    if trials < 1 or not lengths or not rows_:
        raise EvalError(f"need trials >= 1 and at least one length and {placed_by}; got {trials}, {list(lengths)}, {rows_}")
    from fibjax.eval import batching

    predict = predict_fn or model_predict_fn(model_cfg)
    rows = batching.fixed_batch_size(batch_size or trials, mesh)
    params = batching.replicate(params, mesh)
    cells = []
    for length in lengths:
        for place in rows_:
            depth, distance = (float(place), None) if distances is None else (0.0, int(place))
            try:
                prompts = [
                    build_prompt(tokenizer, length, depth, *random_trial(seed, length, depth, i, distance=distance), distance=distance) for i in range(trials)
                ]
            except DistanceDoesNotFit:
                continue  # this distance does not fit in this length: the cell stays empty
            tokens = np.stack([p.tokens[:-1] for p in prompts])
            predicted = batching.in_fixed_batches(predict, params, tokens, rows, mesh)
            exact, frac = score(prompts, predicted)
            cells.append(
                {
                    "length": int(length),
                    "depth": depth,
                    "distance": distance,
                    "actual_depth": float(np.mean([p.depth for p in prompts])),
                    "actual_distance": float(np.mean([p.distance for p in prompts])),
                    "trials": trials,
                    "correct": int(exact.sum()),
                    "accuracy": float(exact.mean()),
                    "token_accuracy": float(frac.mean()),
                    "keys": [p.key for p in prompts],
                    "answers": [tokenizer.decode(pred[p.answer_start - 1 : len(p.tokens) - 1]) for p, pred in zip(prompts, predicted)],
                }
            )
    if not cells:
        raise EvalError(f"no distance of {rows_} fits in any length of {list(lengths)}: pass longer --lengths or shorter --distances")
    grid = {(c["length"], c[placed_by]): c for c in cells}

    def table(field: str) -> list[list]:
        return [[grid[(int(n), place)][field] if (int(n), place) in grid else None for n in lengths] for place in rows_]

    return {
        "lengths": [int(x) for x in lengths],
        "placed_by": placed_by,
        "depths": [float(x) for x in depths] if distances is None else [],
        "distances": [] if distances is None else rows_,
        "trials": trials,
        "seed": seed,
        "scoring": "teacher-forced argmax over every answer token (= greedy decoding exact match)",
        "accuracy": table("accuracy"),
        "correct": table("correct"),
        "token_accuracy": table("token_accuracy"),
        "mean_accuracy": float(np.mean([c["accuracy"] for c in cells])),
        "cells": cells,
        "devices": batching.mesh_devices(mesh),
    }


def training_documents(count: int, seed: int = 0, *, sentences: tuple[int, int] = (8, 60)) -> list[str]:
    """``count`` synthetic pass-key documents, the corpus a small model learns the task from:
    ``sentences`` filler sentences (uniform in the range) in the evaluation's cyclic order from a
    random phase, the needle before a random one of them (or at the end), then the question and
    the key. Keys are 5-digit, drawn from ``seed``; one document is a function of the seed alone."""
    lo, hi = sentences
    if count < 1 or not 1 <= lo <= hi:
        raise EvalError(f"need count >= 1 and 1 <= min <= max sentences; got {count}, {sentences}")
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        n, phase = int(rng.integers(lo, hi + 1)), int(rng.integers(len(FILLER)))
        key, at = str(int(rng.integers(10_000, 100_000))), int(rng.integers(n + 1))
        filler = [FILLER[(phase + i) % len(FILLER)] for i in range(n)]
        documents.append(" ".join([*filler[:at], NEEDLE.format(key=key), *filler[at:], f"{QUESTION} {key}."]))
    return documents


def row_labels(result: dict) -> list[str]:
    """The grid's row labels: depths as percentages, or distances in tokens."""
    if result.get("placed_by", "depth") == "distance":
        return [str(d) for d in result["distances"]]
    return [f"{100 * d:.0f}%" for d in result["depths"]]


# --- outputs ------------------------------------------------------------------------------


def format_markdown(result: dict) -> str:
    """Accuracy (%) with depths as rows and lengths as columns, and a mean row."""
    title = result.get("title", "Passkey retrieval")
    rows = "depth" if result.get("placed_by", "depth") == "depth" else "distance (tokens)"
    head = f"| {rows} \\ length | " + " | ".join(str(n) for n in result["lengths"]) + " |"
    lines = [
        title,
        "",
        f"Exact-match accuracy (%), {result['trials']} trials per cell, seed {result['seed']}.",
        "",
        head,
        "|---|" + "---:|" * len(result["lengths"]),
    ]
    for label, row in zip(row_labels(result), result["accuracy"]):
        lines.append(f"| {label} | " + " | ".join("-" if a is None else f"{100 * a:.0f}" for a in row) + " |")
    means = [np.mean([a for a in column if a is not None]) if any(a is not None for a in column) else None for column in zip(*result["accuracy"])]
    lines.append("| mean | " + " | ".join("-" if a is None else f"{100 * a:.0f}" for a in means) + " |")
    return "\n".join(lines)


def compare_markdown(results: dict[str, dict]) -> str:
    """Several models' grids side by side: a table per length, a row per model, a column per
    depth or distance, each cell exact-match % / answer tokens right %.

    Args:
        results: label -> a ``passkey.json`` result; every one drawn with the same lengths, rows,
            trials and seed (the same prompts), or the table would compare different tests.

    Returns:
        The Markdown tables, with a mean column.

    Raises:
        EvalError: no result, or results that were not drawn with the same prompts.
    """
    if not results:
        raise EvalError("nothing to compare: give at least one passkey.json")
    keys = ("lengths", "placed_by", "depths", "distances", "trials", "seed")
    first_label, first = next(iter(results.items()))
    for label, result in results.items():
        differ = [k for k in keys if result.get(k) != first.get(k)]
        if differ:
            raise EvalError(f"{label} and {first_label} were not drawn with the same prompts: they differ in {', '.join(differ)}")
    labels = row_labels(first)
    unit = "distance (tokens)" if first.get("placed_by", "depth") == "distance" else "depth"
    lines = [
        f"Exact-match accuracy % / answer tokens right %, {first['trials']} trials per cell, seed {first['seed']}; "
        f"columns: the needle's {unit}; '-': does not fit."
    ]
    for j, length in enumerate(first["lengths"]):
        lines += ["", f"At {length:,} tokens:", "", "| model | " + " | ".join(labels) + " | mean |", "|---|" + "---:|" * (len(labels) + 1)]
        for label, result in results.items():
            exact = [row[j] for row in result["accuracy"]]
            tokens = [row[j] for row in result["token_accuracy"]]
            cells = ["-" if a is None else f"{100 * a:.0f} / {100 * t:.0f}" for a, t in zip(exact, tokens)]
            fit = [(a, t) for a, t in zip(exact, tokens) if a is not None]
            mean = f"{100 * np.mean([a for a, _ in fit]):.0f} / {100 * np.mean([t for _, t in fit]):.0f}" if fit else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def write_csv(result: dict, path: Path) -> None:
    fields = ["length", "depth", "distance", "actual_depth", "actual_distance", "trials", "correct", "accuracy", "token_accuracy"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["cells"])


def plot_heatmap(result: dict, path: Path) -> None:
    """Depth (rows, 0% at the top) x length (columns), red 0 -> green 1, every cell labelled."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    from fibjax.eval.plots import fit_titles

    acc = np.asarray([[np.nan if a is None else a for a in row] for row in result["accuracy"]], float)
    n_depths, n_lengths = acc.shape
    fig = Figure(figsize=(1.6 + 1.1 * n_lengths, 1.4 + 0.55 * n_depths), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(n_lengths), [str(n) for n in result["lengths"]])
    ax.set_yticks(range(n_depths), row_labels(result))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (0% = start)" if result.get("placed_by", "depth") == "depth" else "filler tokens between needle and question")
    ax.set_xticks(np.arange(-0.5, n_lengths), minor=True)
    ax.set_yticks(np.arange(-0.5, n_depths), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    for (i, j), a in np.ndenumerate(acc):
        if np.isnan(a):
            ax.text(j, i, "does not fit", ha="center", va="center", fontsize=7, color="grey")
            continue
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
