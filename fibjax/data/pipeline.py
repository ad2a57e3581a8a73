"""The Grain training input: seeded random windows of seq_len+1 tokens from a weighted mixture.

All of it is Grain's own map-style dataset (``grain.MapDataset``), so every element is a pure
function of its index and nothing before it is ever produced:

  - each training source is an endless ``range(...).random_map(...)``: element ``i`` is a
    window at a uniformly random start in that source's train tokens, from Grain's per-element
    generator (seeded with the run's seed and the source's position);
  - ``MapDataset.mix`` interleaves the sources in the mixture's proportions (deterministically:
    in every cycle each source appears its share of times);
  - ``batch(local)`` groups rows, and ``[process_index::process_count]`` is Grain's per-process
    sharding: global step ``s`` is elements ``[s*G, (s+1)*G)`` of the mixture, and process ``p``
    of ``P`` takes rows ``[p*local, (p+1)*local)`` of it, ``local = G // P``, so the processes'
    rows together are the 1-process batch;
  - resume is one integer (Grain's iterator state, saved by ``grain.checkpoint.CheckpointSave``
    with the model).

Windows may cross document boundaries (EOS separates documents), as in GPT-style training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grain
import numpy as np

from fibjax.data.sources import DataError
from fibjax.data.token_files import check_token_ids, load_meta, validation_sources, validation_tokens

__all__ = ["load_meta", "mixture_weights", "train_iterator", "validation_sources", "validation_tokens"]


def mixture_weights(meta: dict, weights: dict[str, float]) -> dict[str, float]:
    """Normalised sampling probability of each training source (sorted by name). ``{}`` means
    proportional to train tokens; otherwise only the named sources are sampled.

    Args:
        meta: The prepared data's ``meta.json``.
        weights: {source: weight} (``data.weights``), or ``{}``.

    Returns:
        {source: probability}, summing to 1.

    Raises:
        DataError: A weight names an unknown training source or is not positive.
    """
    train = {name: s["train"]["tokens"] for name, s in sorted(meta["sources"].items()) if "train" in s}
    if not weights:
        weights = train
    unknown = sorted(set(weights) - set(train))
    if unknown:
        raise DataError(f"data.weights names unknown training source(s) {unknown}; the prepared data has {sorted(train)}")
    if any(w <= 0 for w in weights.values()):
        raise DataError(f"data.weights must be positive, got {weights}")
    total = float(sum(weights.values()))
    return {name: weights[name] / total for name in sorted(weights)}


class _RandomWindow:
    """Grain ``random_map`` transform: (index, generator) -> an int32 window of ``window`` tokens
    at a uniformly random start of one source's train tokens."""

    def __init__(self, file: Path, length: int, window: int, dtype: np.dtype):
        self.file, self.length, self.window, self.dtype = file, length, window, dtype
        self._tokens: np.memmap | None = None

    def __getstate__(self):  # worker processes reopen the memmap instead of receiving a copy
        return self.__dict__ | {"_tokens": None}

    def __call__(self, _index: int, rng: np.random.Generator) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.file, dtype=self.dtype, mode="r")
        start = int(rng.integers(0, self.length - self.window + 1))
        return np.asarray(self._tokens[start : start + self.window], np.int32)


def train_iterator(
    data_dir: str | os.PathLike,
    weights: dict[str, float],
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    worker_count: int = 0,
) -> grain.DatasetIterator:
    """An endless Grain iterator of int32 ``[global_batch // process_count, seq_len + 1]``
    batches for this process (inputs are ``[:, :-1]``, targets ``[:, 1:]``).

    ``worker_count`` > 0 reads that many steps ahead in background threads; the batches and
    the checkpointed state are the same either way.

    Args:
        data_dir: The prepared data.
        weights: {source: weight}, or ``{}`` (see [mixture_weights][fibjax.data.mixture_weights]).
        seq_len: Tokens per example, before the extra target token.
        global_batch: Examples per step, over all processes.
        seed: The shuffling and mixing seed.
        process_index: This process's index.
        process_count: The number of processes.
        worker_count: Steps read ahead in background threads.

    Returns:
        The iterator (its state is checkpointable).

    Raises:
        DataError: A bad size, process index or worker count, or a source shorter than
            ``seq_len + 1`` tokens.
    """
    if seq_len < 1 or global_batch < 1:
        raise DataError(f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index must lie in [0, {process_count}), got {process_index}")
    if global_batch % process_count:
        raise DataError(f"global_batch {global_batch} is not divisible by the number of processes {process_count}")
    if worker_count < 0:
        raise DataError(f"worker_count must be >= 0, got {worker_count}")
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    probs = mixture_weights(meta, weights)
    window = seq_len + 1
    for name in probs:
        tokens = meta["sources"][name]["train"]["tokens"]
        if tokens < window:
            raise DataError(f"source {name!r} has {tokens} train tokens, fewer than seq_len + 1 = {window}; use a shorter seq_len or more data")
        check_token_ids(data_dir / meta["sources"][name]["train"]["file"], np.dtype(meta["dtype"]), meta["tokenizer"]["vocab_size"])
    local = global_batch // process_count
    sources = [
        grain.MapDataset.range(sys.maxsize).random_map(
            _RandomWindow(data_dir / meta["sources"][name]["train"]["file"], meta["sources"][name]["train"]["tokens"], window, np.dtype(meta["dtype"])),
            seed=int(np.random.SeedSequence((seed % 2**64, k)).generate_state(1)[0]),
        )
        for k, name in enumerate(probs)
    ]
    mixture = grain.MapDataset.mix(sources, weights=list(probs.values())) if len(sources) > 1 else sources[0]
    # drop_remainder: the windows are endless, and grain's length of an undropped batch of one (a
    # float ceil of sys.maxsize) overflows; the batches themselves are the same either way.
    steps = mixture.batch(local, drop_remainder=True, batch_fn=np.stack)[process_index::process_count]
    read = grain.ReadOptions(num_threads=worker_count, prefetch_buffer_size=2 * worker_count)
    return iter(steps.to_iter_dataset(read))
