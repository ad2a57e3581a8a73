"""Perplexity of one model on one token stream at several lengths, and NLL by position.

Every length scores the SAME tokens: the stream's first N + 1 tokens, N a multiple of every
length, cut into non-overlapping windows; each window is scored from its own start (no
carried context), so the number of scored tokens is N at every length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fibjax.config import ModelConfig
from fibjax.errors import FibjaxError
from fibjax.eval import batching

NUM_BINS = 8


class EvalError(FibjaxError, ValueError):
    """An evaluation cannot run as asked (data too short for the lengths, a non-finite result, ...)."""


@dataclass
class LengthResult:
    """Perplexity of one validation stream at one length (the report's per-length entry)."""

    length: int
    tokens: int  # scored tokens (equal at every length)
    nll: float  # mean negative log-likelihood, nats per token
    ppl: float
    bin_nll: list[float]  # mean NLL in NUM_BINS equal bins of positions over the window

    def as_dict(self) -> dict:
        """The result as a dict (the report's JSON).

        Returns:
            {field: value}.
        """
        return asdict(self)


def scored_tokens(stream_len: int, lengths: list[int], max_tokens: int) -> int:
    """Largest N <= max_tokens, N + 1 <= stream length, divisible by every length."""
    unit = math.lcm(*lengths)
    n = min(max_tokens, stream_len - 1) // unit * unit
    if n == 0:
        raise EvalError(f"the validation stream has {stream_len} tokens: too short for one window of {unit} tokens (+1) at lengths {lengths}")
    return n


def windows(stream: np.ndarray, n: int, length: int) -> np.ndarray:
    """[n / length, length + 1] int32: inputs and their next-token targets, non-overlapping."""
    x = np.asarray(stream[: n + 1], dtype=np.int32)
    rows = n // length
    starts = np.arange(rows)[:, None] * length
    return x[starts + np.arange(length + 1)[None, :]]


def evaluate_lengths(  # noqa: DOC502
    model_cfg: ModelConfig, params: dict, stream: np.ndarray, lengths: list[int], *, max_tokens: int, rows_tokens: int, mesh: jax.sharding.Mesh | None = None
) -> list[LengthResult]:
    """Perplexity at each length; ``rows_tokens`` bounds tokens per forward (memory). With a
    ``mesh``, the windows of a batch are split over its data and fsdp axes (data parallel, the
    parameters replicated), so a pod's checkpoint evaluates on the pod.

    Args:
        model_cfg: The model's config.
        params: The model's parameters.
        stream: The validation tokens (documents separated by EOS).
        lengths: The evaluation lengths.
        max_tokens: The most tokens scored at each length.
        rows_tokens: The most tokens per forward.
        mesh: A device mesh to split the windows over.

    Returns:
        One [LengthResult][fibjax.eval.LengthResult] per length.

    Raises:
        EvalError: A stream too short for one window at the lengths given.
    """
    nll_fn = batching.on_model(model_cfg, batching.next_token_nll)
    n = scored_tokens(len(stream), lengths, max_tokens)
    params = batching.replicate(params, mesh)
    results = []
    for length in lengths:
        tokens = windows(stream, n, length)
        nll = batching.in_fixed_batches(nll_fn, params, tokens, batching.fixed_batch_size(rows_tokens // length, mesh), mesh)
        bins = [float(b.mean()) for b in np.array_split(nll, NUM_BINS, axis=1)]
        mean = float(nll.mean())
        results.append(LengthResult(length, int(nll.size), mean, math.exp(mean), bins))
    return results


def dropped_mass_head(model, tokens_BL1: jax.Array) -> jax.Array:
    """Dropped attention mass [B, num_layers]: per sequence and layer, the mean over queries and
    heads of 1 - exp(lse_pattern - lse_dense) (paper B)."""
    _, sown = nnx.capture(model, nnx.Intermediate)(tokens_BL1[:, :-1], probe_dropped_mass=True)
    return jnp.stack([sown["blocks"][i]["attn"]["dropped_mass"][0] for i in range(model.cfg.num_layers)], axis=1)


def dropped_mass_by_layer(
    model_cfg: ModelConfig, params, stream: np.ndarray, length: int, *, max_tokens: int, rows_tokens: int, mesh: jax.sharding.Mesh | None = None
) -> list[float]:
    """Dropped mass per layer, the mean over every window of ``length`` (up to ``max_tokens``
    tokens); with a ``mesh``, the windows are split over its data axes as in ``evaluate_lengths``."""
    tokens = windows(stream, scored_tokens(len(stream), [length], max_tokens), length)
    fn = batching.on_model(model_cfg, dropped_mass_head)
    per_row = batching.in_fixed_batches(fn, batching.replicate(params, mesh), tokens, batching.fixed_batch_size(rows_tokens // length, mesh), mesh)
    return [float(x) for x in per_row.mean(axis=0)]
