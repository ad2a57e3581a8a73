"""The probe's two synthetic tasks, their training-distance samplers, and their scoring.

**Retrieval at distance** (task 1). Random filler; a target key/value bigram (K*, V*) planted so
that V* sits exactly d positions before the last position; ``n_distract`` distractor bigrams at
other non-overlapping places; the last token is K* again (the query), and the model must name
V* there. Filler, keys and values come from disjoint token ranges, and the keys (and values) of
one sequence are distinct, so exactly one earlier key matches the query. The loss and a
forced-choice accuracy (argmax among the values present) are read only at the query position.

**Marked two-distance copy** (task 2). Every position t carries a payload p_t and a marker c_t
in {0, 1} in one token id (p_t + c_t * P); the target at t is the id at t - d[c_t]. So one
forward pass needs both distances d1 and d2 at once, and accuracy is read at each separately.

Everything here is NumPy on the host: a batch is a pure function of its generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fibjax.errors import FibjaxError


class ProbeError(FibjaxError, ValueError):
    """A probe setting that cannot run (a distance that does not fit, an unknown condition), or
    nothing to report; the message says which."""


@dataclass(frozen=True)
class Vocab:
    """Task 1's disjoint token ranges: filler [0, F), keys [F, F+K), values [F+K, F+K+V)."""

    filler: int = 64
    keys: int = 32
    values: int = 32

    def __post_init__(self):
        if min(self.filler, self.keys, self.values) < 1:
            raise ProbeError(f"every token range needs at least one id, got {self}")

    @property
    def size(self) -> int:
        return self.filler + self.keys + self.values

    @property
    def key_ids(self) -> range:
        return range(self.filler, self.filler + self.keys)

    @property
    def value_ids(self) -> range:
        return range(self.filler + self.keys, self.size)


@dataclass
class RetrievalBatch:
    inputs: np.ndarray  # [B, T] int32; inputs[:, -1] is the query key
    target: np.ndarray  # [B] int32: V*, the answer at the query
    choices: np.ndarray  # [B, 1 + n_distract] int32: the values present, target first
    distance: int  # V* sits at T - 1 - distance (K* one before it)

    def as_train_batch(self) -> dict[str, np.ndarray]:
        """inputs / targets / weights for ``fibjax.train.step``: the loss only at the query."""
        b, t = self.inputs.shape
        targets = np.zeros((b, t), np.int32)
        targets[:, -1] = self.target
        weights = np.zeros((b, t), np.float32)
        weights[:, -1] = 1.0
        return {"inputs": self.inputs, "targets": targets, "weights": weights}


def max_retrieval_distance(seq_len: int) -> int:
    """The largest d that fits: K* at T - 2 - d must be >= 0."""
    return seq_len - 2


def retrieval_batch(rng: np.random.Generator, batch: int, seq_len: int, distance: int, n_distract: int, vocab: Vocab) -> RetrievalBatch:
    """Task 1: ``batch`` sequences of ``seq_len`` tokens, V* at distance ``distance`` from the query."""
    t, d = seq_len, distance
    if not 1 <= d <= max_retrieval_distance(t):
        raise ProbeError(f"distance {d} does not fit in a sequence of {t} tokens (1 <= d <= {max_retrieval_distance(t)})")
    if 1 + n_distract > min(vocab.keys, vocab.values):
        raise ProbeError(f"{1 + n_distract} distinct keys and values needed, the vocab has {vocab.keys} keys and {vocab.values} values")
    key_pos, value_pos = t - 2 - d, t - 1 - d
    segments = ((0, key_pos), (value_pos + 1, t - 1))  # the free cells before and after the target, the query excluded
    if n_distract > sum((hi - lo) // 2 for lo, hi in segments):
        raise ProbeError(f"{n_distract} distractor bigrams do not fit in {t} tokens with the target at distance {d}")
    x = rng.integers(0, vocab.filler, (batch, t), dtype=np.int32)
    keys = np.stack([rng.choice(vocab.keys, 1 + n_distract, replace=False) for _ in range(batch)]).astype(np.int32) + vocab.filler
    values = np.stack([rng.choice(vocab.values, 1 + n_distract, replace=False) for _ in range(batch)]).astype(np.int32) + vocab.filler + vocab.keys
    x[:, key_pos], x[:, value_pos], x[:, -1] = keys[:, 0], values[:, 0], keys[:, 0]
    for row in range(batch):
        starts = bigram_starts(rng, segments, n_distract)
        x[row, starts], x[row, starts + 1] = keys[row, 1:], values[row, 1:]
    return RetrievalBatch(x, values[:, 0].copy(), values, d)


def bigram_starts(rng: np.random.Generator, segments, k: int) -> np.ndarray:
    """Starts of ``k`` non-overlapping bigrams inside the cell ranges ``segments`` ([lo, hi)),
    uniform over all such placements, in random order. A segment of m cells holds j bigrams in
    C(m - j, j) ways (j blocks of 2 among m - 2j single cells); the bigrams are split between the
    segments in proportion to those counts, then placed by choosing the blocks' ranks."""
    (a_lo, a_hi), (b_lo, b_hi) = segments
    ma, mb = a_hi - a_lo, b_hi - b_lo
    splits = [j for j in range(k + 1) if 2 * j <= ma and 2 * (k - j) <= mb]
    ways = np.array([math.comb(ma - j, j) * math.comb(mb - (k - j), k - j) for j in splits], np.float64)
    ka = splits[int(rng.choice(len(splits), p=ways / ways.sum()))]
    starts = []
    for lo, m, j in ((a_lo, ma, ka), (b_lo, mb, k - ka)):
        ranks = np.sort(rng.choice(m - j, j, replace=False))
        starts += [lo + r + i for i, r in enumerate(ranks)]  # the i-th block starts after i earlier blocks of 2
    return rng.permutation(np.asarray(starts, np.int64))


@dataclass
class MarkedBatch:
    inputs: np.ndarray  # [B, T] int32: payload + marker * payload_vocab
    marker: np.ndarray  # [B, T] int32 in {0, 1}: which distance position t copies from
    targets: np.ndarray  # [B, T] int32: inputs[t - d[marker[t]]] (0 where that is before the start)
    valid: np.ndarray  # [B, T] bool: t >= d[marker[t]]
    distances: tuple[int, int]

    def as_train_batch(self) -> dict[str, np.ndarray]:
        return {"inputs": self.inputs, "targets": self.targets, "weights": self.valid.astype(np.float32)}


def marked_batch(rng: np.random.Generator, batch: int, seq_len: int, distances: tuple[int, int], payload_vocab: int) -> MarkedBatch:
    """Task 2: ids in [0, 2 * payload_vocab); position t copies the id d[marker_t] back."""
    if len(distances) != 2 or not all(1 <= d < seq_len for d in distances) or distances[0] == distances[1]:
        raise ProbeError(f"two different distances in [1, {seq_len - 1}] needed, got {distances}")
    payload = rng.integers(0, payload_vocab, (batch, seq_len), dtype=np.int32)
    marker = rng.integers(0, 2, (batch, seq_len), dtype=np.int32)
    x = payload + marker * payload_vocab
    pos = np.arange(seq_len)
    d_BT = np.asarray(distances)[marker]
    valid = pos >= d_BT
    targets = np.where(valid, np.take_along_axis(x, np.maximum(pos - d_BT, 0), axis=1), 0).astype(np.int32)
    return MarkedBatch(x, marker, targets, valid, tuple(distances))


# --- training distances ----------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """The training distances lo..hi (inclusive)."""

    lo: int
    hi: int

    @classmethod
    def around(cls, centre: int, width: int) -> Band:
        """centre - width // 2 .. centre + width // 2 (the reference's band)."""
        return cls(centre - width // 2, centre + width // 2)

    @property
    def centre(self) -> int:
        return (self.lo + self.hi) // 2

    def distances(self) -> range:
        return range(self.lo, self.hi + 1)

    def label(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class DistanceSampler:
    """One training distance per step: uniform over a range (one band), or over several bands
    (a band drawn uniformly, then a distance in it)."""

    bands: tuple[Band, ...]

    def __post_init__(self):
        if not self.bands or any(b.lo < 1 or b.hi < b.lo for b in self.bands):
            raise ProbeError(f"bands need 1 <= lo <= hi, got {self.bands}")

    def draw(self, rng: np.random.Generator) -> int:
        band = self.bands[int(rng.integers(len(self.bands)))]
        return int(rng.integers(band.lo, band.hi + 1))

    def support(self) -> list[int]:
        return sorted({d for b in self.bands for d in b.distances()})

    def label(self) -> str:
        return ", ".join(b.label() for b in self.bands)


# --- scoring ------------------------------------------------------------------------------------


def forced_choice_correct(logits_BV: np.ndarray, choices_BN: np.ndarray, target_B: np.ndarray) -> np.ndarray:
    """[B] expected correctness of "pick the highest-scoring value present": 1 if the target
    alone has the top logit among ``choices``, 1/k if it ties with k - 1 others (ties broken at
    random), 0 otherwise. Uniform logits therefore score chance, 1 / N."""
    scores_BN = np.take_along_axis(np.asarray(logits_BV, np.float64), choices_BN, axis=1)
    top_BN = scores_BN == scores_BN.max(axis=1, keepdims=True)
    is_target_BN = choices_BN == np.asarray(target_B)[:, None]
    return (top_BN & is_target_BN).any(axis=1) / top_BN.sum(axis=1)


def marked_correct(pred_BT: np.ndarray, batch: MarkedBatch) -> dict[int, tuple[int, int]]:
    """{d: (correct, counted)} over the positions that copy from d (argmax over the full vocab)."""
    hit = pred_BT == batch.targets
    out = {}
    for j, d in enumerate(batch.distances):
        sel = batch.valid & (batch.marker == j)
        out[d] = (int((hit & sel).sum()), int(sel.sum()))
    return out
