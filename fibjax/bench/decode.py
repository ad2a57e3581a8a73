"""``python -m launch.bench decode``: per-token latency and KV-cache memory against the context.

Four models of the same size that differ only in attention, named by their kinds: offset
(Fibonacci, staggered alpha, window 12 by default), block_sparse (MoBA: 16 blocks of 16 keys,
paper B's receptive field 256; SSA's sparse inference), nsa (NSA: the same 16 blocks of 16 keys
selected, every block's compressed key and value, and a window of 128, half the selection's
receptive field as in the CPU config) and dense. For each context n a decoder is built with capacity n, its
cache filled with random keys and values (their values do not change the work), and ``steps``
tokens are timed one by one at positions n - steps .. n - 1 (each step synchronised); the
median and the fastest step are reported. Cache MiB is the size of every layer's buffers: ring
buffers of (largest distance + 1) rows for the offset model, n rows per layer for the others
(plus block_sparse's block key sums and nsa's compressed blocks). "read" is what one token's
attention reads from the cache, all layers (``AttentionKind.read_bytes``): every row for dense;
the block sums and the S x B selected rows for block_sparse; the compressed blocks, the S x B
selected rows and the window for nsa; the attended rows for the offset model.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from fibjax import kinds as kinds_lib
from fibjax.config import AttentionConfig, ModelConfig
from fibjax.decode import KV, Decoder, cache_bytes
from fibjax.model import Transformer, count_params

KINDS = ("offset", "block_sparse", "nsa", "dense")


@dataclass(frozen=True)
class Spec:
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 32768
    window: int = 12
    block_size: int = 16
    num_blocks: int = 16
    nsa_window: int = 128
    dtype: str = "float32"

    def model_config(self, kind: str) -> ModelConfig:
        attention = {
            "offset": AttentionConfig(kind="offset", base="fibonacci", alpha="staggered", window=self.window),
            "block_sparse": AttentionConfig(kind="block_sparse", block_size=self.block_size, num_blocks=self.num_blocks),
            "nsa": AttentionConfig(kind="nsa", block_size=self.block_size, num_blocks=self.num_blocks, window=self.nsa_window),
            "dense": AttentionConfig(kind="dense"),
        }[kind]
        return ModelConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            dtype=self.dtype,
            attention=attention,
        )


@dataclass
class Row:
    ms: float  # median time of one step (one new token)
    best_ms: float  # the fastest step (the least disturbed by other load)
    cache_mib: float
    read_mib: float  # cache bytes one token's attention reads, all layers
    rows: list[int]  # cache rows per layer


def random_cache(decoder: Decoder, key) -> tuple[KV, ...]:
    cache = decoder.init_cache(1)
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)])


def read_bytes(decoder: Decoder, cache) -> int:
    """Cache bytes one token's attention reads, all layers (each layer's kind says what it reads)."""
    return sum(plan.kind.read_bytes(plan, kv) for plan, kv in zip(decoder.plans, cache))


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
    return Row(statistics.median(times), min(times), size / 2**20, read_bytes(decoder, cache) / 2**20, [p.rows for p in decoder.plans])


def run(spec: Spec, contexts: list[int], steps: int, kinds=KINDS, progress=None) -> tuple[dict[tuple[str, int], Row], dict[str, int]]:
    """{(kind, context): Row} and the parameter count of each model (``kinds``: a subset of KINDS)."""
    results, params = {}, {}
    for kind in kinds:
        model = Transformer(spec.model_config(kind), rngs=nnx.Rngs(0))
        params[kind] = count_params(model)
        for n in contexts:
            results[(kind, n)] = measure(model, n, steps)
            if progress:
                progress(f"{kind} {n} done")
    return results, params


def table(results: dict[tuple[str, int], Row], contexts: list[int]) -> str:
    kinds = [k for k in KINDS if (k, contexts[0]) in results]
    full = kinds_lib.FULL  # the row every sparse kind is compared with
    sparse = [k for k in kinds if kinds_lib.get(k).sparse] if full in kinds else []
    lines = [
        "| context | "
        + " | ".join(f"{k} ms/token (best)" for k in kinds)
        + " | "
        + " | ".join(f"{full} / {k}" for k in sparse)
        + f" | read MiB/token {' / '.join(kinds)} | cache MiB {' / '.join(kinds)} |",
        "|---:|" + "---:|" * (len(kinds) + len(sparse)) + "---|---|",
    ]
    for n in contexts:
        rows = {k: results[(k, n)] for k in kinds}
        cells = [f"{r.ms:.2f} ({r.best_ms:.2f})" for r in rows.values()] + [f"{rows[full].ms / rows[k].ms:.1f}x" for k in sparse]
        reads, caches = (" / ".join(f"{getattr(r, f):.{p}f}" for r in rows.values()) for f, p in (("read_mib", 2), ("cache_mib", 1)))
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {reads} | {caches} |")
    lines.append("")
    for k in [k for k in sparse if kinds_lib.get(k).bounded_context]:  # the kinds whose cache grows with the context
        crossover = next((n for n in contexts if results[(k, n)].ms < results[(full, n)].ms), None)
        lines.append(f"{k} is faster than {full} from context {crossover} on" if crossover else f"{k} was not faster than {full} at any context measured")
    return "\n".join(lines)
