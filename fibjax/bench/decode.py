"""``python -m launch.bench decode``: per-token latency and KV-cache memory against the context.

Two models of the same size that differ only in attention: sparse (Fibonacci, staggered alpha,
window 12 by default) and dense. For each context n a decoder is built with capacity n, its
cache filled with random keys and values (their values do not change the work), and ``steps``
tokens are timed one by one at positions n - steps .. n - 1 (each step synchronised); the
median and the fastest step are reported. Cache MiB is the size of every layer's K and V buffers: ring buffers of
(largest distance + 1) rows for the sparse model, n rows per layer for the dense one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from fibjax.config import AttentionConfig, ModelConfig
from fibjax.decode import Decoder, cache_bytes
from fibjax.decode.cache import KV
from fibjax.model import Transformer, count_params

KINDS = ("sparse", "dense")


@dataclass(frozen=True)
class Spec:
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 32768
    window: int = 12
    dtype: str = "float32"

    def model_config(self, kind: str) -> ModelConfig:
        sparse = AttentionConfig(kind="offset", base="fibonacci", alpha="staggered", window=self.window)
        attention = sparse if kind == "sparse" else AttentionConfig(kind="dense")
        return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, dtype=self.dtype, attention=attention)


@dataclass
class Row:
    ms: float  # median time of one step (one new token)
    best_ms: float  # the fastest step (the least disturbed by other load)
    cache_mib: float
    rows: list[int]  # cache rows per layer


def random_cache(decoder: Decoder, key) -> tuple[KV, ...]:
    cache = decoder.init_cache(1)
    keys = jax.random.split(key, 2 * len(cache))
    return tuple(KV(*(jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys[2 * i : 2 * i + 2], kv))) for i, kv in enumerate(cache))


def measure(model: Transformer, context: int, steps: int) -> Row:
    decoder = Decoder(model, max_len=context)
    cache = random_cache(decoder, jax.random.key(0))
    size = cache_bytes(cache)
    token = jnp.zeros((1,), jnp.int32)
    cache, _, token = decoder.step(cache, token, context - steps - 1)  # compile and warm up
    times = []
    for pos in range(context - steps, context):
        start = time.perf_counter()
        cache, _, token = decoder.step(cache, token, pos)
        jax.block_until_ready(token)
        times.append((time.perf_counter() - start) * 1e3)
    return Row(statistics.median(times), min(times), size / 2**20, [p.rows for p in decoder.plans])


def run(spec: Spec, contexts: list[int], steps: int, progress=None) -> tuple[dict[tuple[str, int], Row], dict[str, int]]:
    """{(kind, context): Row} and the parameter count of each model."""
    results, params = {}, {}
    for kind in KINDS:
        model = Transformer(spec.model_config(kind), rngs=nnx.Rngs(0))
        params[kind] = count_params(model)
        for n in contexts:
            results[(kind, n)] = measure(model, n, steps)
            if progress:
                progress(f"{kind} {n} done")
    return results, params


def table(results: dict[tuple[str, int], Row], contexts: list[int]) -> str:
    lines = ["| context | sparse ms/token (best) | dense ms/token (best) | dense / sparse | sparse cache MiB | dense cache MiB | sparse rows per layer |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for n in contexts:
        s, d = results[("sparse", n)], results[("dense", n)]
        lines.append(f"| {n} | {s.ms:.2f} ({s.best_ms:.2f}) | {d.ms:.2f} ({d.best_ms:.2f}) | {d.ms / s.ms:.1f}x "
                     f"| {s.cache_mib:.1f} | {d.cache_mib:.1f} | {' '.join(map(str, s.rows))} |")
    return "\n".join(lines)
