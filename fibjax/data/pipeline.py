"""The Grain training input: seeded random windows of seq_len+1 tokens from a weighted mixture.

Element ``s`` of the Grain dataset is global step ``s``. Row ``j`` of global step ``s`` is a
pure function of ``(seed, s, j)``: a generator seeded with that triple picks the source (by
the mixture weights) and a uniformly random start in that source's train tokens. So

  - any step can be produced without producing the ones before (resume is one integer: Grain's
    iterator state, saved by ``grain.checkpoint.CheckpointSave`` with the model);
  - process ``p`` of ``P`` computes only rows ``[p*local, (p+1)*local)`` of each global batch,
    ``local = global_batch // P``, and the processes' rows together are the 1-process batch.

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
    proportional to train tokens; otherwise only the named sources are sampled."""
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


class _WindowSampler:
    """Maps a global step to this process's rows: ``[local, seq_len + 1]`` int32 windows."""

    def __init__(self, data_dir: Path, meta: dict, probs: dict[str, float], window: int, seed: int, rows: range):
        self.files = [data_dir / meta["sources"][n]["train"]["file"] for n in probs]
        self.lengths = [meta["sources"][n]["train"]["tokens"] for n in probs]
        self.dtype = np.dtype(meta["dtype"])
        self.cumulative = np.cumsum(list(probs.values()))
        self.window, self.seed, self.rows = window, seed % 2**64, rows
        self._tokens: list[np.memmap] | None = None

    def __getstate__(self):  # worker processes reopen the memmaps instead of receiving copies
        return self.__dict__ | {"_tokens": None}

    def __call__(self, step: int):
        if self._tokens is None:
            self._tokens = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        out_BL = np.empty((len(self.rows), self.window), np.int32)
        for i, row in enumerate(self.rows):
            rng = np.random.default_rng((self.seed, int(step), row))
            source = min(int(np.searchsorted(self.cumulative, rng.random(), side="right")), len(self.files) - 1)
            start = int(rng.integers(0, self.lengths[source] - self.window + 1))
            out_BL[i] = self._tokens[source][start : start + self.window]
        return out_BL


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
    the checkpointed state are the same either way."""
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
    sampler = _WindowSampler(data_dir, meta, probs, window, seed, range(process_index * local, (process_index + 1) * local))
    steps = grain.MapDataset.range(sys.maxsize).map(sampler)
    read = grain.ReadOptions(num_threads=worker_count, prefetch_buffer_size=2 * worker_count)
    return iter(steps.to_iter_dataset(read))
