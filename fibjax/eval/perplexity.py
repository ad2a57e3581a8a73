"""Perplexity of one model on one token stream at several lengths, and NLL by position.

Every length scores the SAME tokens: the stream's first N + 1 tokens, N a multiple of every
length, cut into non-overlapping windows; each window is scored from its own start (no
carried context), so the number of scored tokens is N at every length.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from fibjax.attention.sharded import BATCH_AXES
from fibjax.config import ModelConfig
from fibjax.model import graphdef_of

NUM_BINS = 8


class EvalError(ValueError):
    pass


@dataclass
class LengthResult:
    length: int
    tokens: int  # scored tokens (equal at every length)
    nll: float  # mean negative log-likelihood, nats per token
    ppl: float
    bin_nll: list[float]  # mean NLL in NUM_BINS equal bins of positions over the window

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=16)  # one compile per architecture, whatever the number of datasets
def token_nll_fn(model_cfg: ModelConfig):
    """Jitted (params, tokens [B, L+1]) -> NLL [B, L] float32 for this architecture."""
    graphdef = graphdef_of(model_cfg)

    @jax.jit
    def nll(params, tokens_BL1):  # model.logits_chunk bounds the logits' memory
        return nnx.merge(graphdef, params)(tokens_BL1[:, :-1], targets_BT=tokens_BL1[:, 1:])

    return nll


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


def evaluate_lengths(model_cfg: ModelConfig, params, stream: np.ndarray, lengths: list[int], *, max_tokens: int, rows_tokens: int,
                     mesh: jax.sharding.Mesh | None = None) -> list[LengthResult]:
    """Perplexity at each length; ``rows_tokens`` bounds tokens per forward (memory). With a
    ``mesh``, the windows of a batch are split over its data and fsdp axes (data parallel, the
    parameters replicated), so a pod's checkpoint evaluates on the pod."""
    nll_fn = token_nll_fn(model_cfg)
    n = scored_tokens(len(stream), lengths, max_tokens)
    shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES)
    if mesh is not None:
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    results = []
    for length in lengths:
        tokens = windows(stream, n, length)
        rows = -(-max(1, rows_tokens // length) // shards) * shards  # a whole number of rows per shard
        nll = np.concatenate([_padded_call(nll_fn, params, tokens[i : i + rows], rows, mesh) for i in range(0, len(tokens), rows)])
        bins = [float(b.mean()) for b in np.array_split(nll, NUM_BINS, axis=1)]
        mean = float(nll.mean())
        results.append(LengthResult(length, int(nll.size), mean, math.exp(mean), bins))
    return results


def _padded_call(fn, params, tokens: np.ndarray, rows: int, mesh=None) -> np.ndarray:
    """Call with a fixed batch of ``rows`` (one compile per length), dropping padded rows."""
    real = len(tokens)
    if real < rows:
        tokens = np.concatenate([tokens, np.zeros((rows - real, tokens.shape[1]), tokens.dtype)])
    batch = jnp.asarray(tokens) if mesh is None else jax.device_put(tokens, NamedSharding(mesh, PartitionSpec(BATCH_AXES)))
    return np.asarray(fn(params, batch))[:real]


@functools.lru_cache(maxsize=16)
def dropped_mass_fn(model_cfg: ModelConfig):
    """Jitted (params, tokens [B, L+1]) -> dropped attention mass per layer [num_layers]:
    the mean over queries and heads of 1 - exp(lse_pattern - lse_dense) (paper B)."""
    graphdef = graphdef_of(model_cfg)

    @jax.jit
    def mass(params, tokens_BL1):
        _, sown = nnx.capture(nnx.merge(graphdef, params), nnx.Intermediate)(tokens_BL1[:, :-1], probe_dropped_mass=True)
        per_layer = sown["blocks"]
        return jnp.stack([per_layer[i]["attn"]["dropped_mass"][0] for i in range(model_cfg.num_layers)])

    return mass


def dropped_mass_by_layer(model_cfg: ModelConfig, params, stream: np.ndarray, length: int, *, max_tokens: int, rows_tokens: int) -> list[float]:
    """Dropped mass per layer over windows of ``length`` (up to ``max_tokens`` tokens, in equal
    batches of windows: a remainder smaller than one batch is left out)."""
    tokens = windows(stream, scored_tokens(len(stream), [length], max_tokens), length)
    rows = max(1, min(len(tokens), rows_tokens // length))
    fn = dropped_mass_fn(model_cfg)
    per_batch = [np.asarray(fn(params, jnp.asarray(tokens[i : i + rows]))) for i in range(0, len(tokens) // rows * rows, rows)]
    return [float(x) for x in np.mean(per_batch, axis=0)]
