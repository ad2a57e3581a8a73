"""Next-token choice: greedy, temperature, top-k and top-p (nucleus), seeded by jax.random.

Order of operations: ids at or beyond ``vocab_size`` are removed (a model vocabulary larger
than its tokenizer's), logits are divided by the temperature, then top-k, then top-p on the
tempered distribution, then one categorical draw. Ties at a threshold are kept (top-k may keep
more than k ids when logits are equal). Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from fibjax.errors import FibjaxError

Array = jax.Array


class SampleError(FibjaxError, ValueError):
    """The run cannot be sampled as asked; the message says why and what to do."""


def top_k_mask(logits_BV: Array, k: int) -> Array:
    """True for the ids whose logit is at least the k-th largest.

    Args:
        logits_BV: Logits [B, V].
        k: How many ids to keep.

    Returns:
        The mask [B, V].
    """
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][..., -1:]
    return logits_BV >= kth_B1


def top_p_mask(logits_BV: Array, p: float) -> Array:
    """True for the smallest set of most likely ids whose probability sums to >= p (never empty).

    Args:
        logits_BV: Logits [B, V].
        p: The probability to cover, in (0, 1].

    Returns:
        The mask [B, V].
    """
    sorted_BV = jnp.sort(logits_BV, axis=-1)[..., ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the strictly more likely ids
    kept_B1 = jnp.sum(before_BV < p, axis=-1, keepdims=True)  # >= 1: the first id has mass 0 before it
    threshold_B1 = jnp.take_along_axis(sorted_BV, kept_B1 - 1, axis=-1)
    return logits_BV >= threshold_B1


@dataclass(frozen=True)
class Sampler:
    """How to pick the next token from logits [B, V]; hashable, so a static argument of jit."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    vocab_size: int | None = None  # ids >= this are never chosen (None: every id)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SampleError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SampleError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SampleError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise SampleError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def filtered_logits(self, logits_BV: Array) -> Array:
        """float32 logits / temperature with every excluded id at -inf.

        Args:
            logits_BV: Logits [B, V].

        Returns:
            The filtered logits [B, V] float32.
        """
        x = logits_BV.astype(jnp.float32)
        if self.vocab_size is not None and self.vocab_size < x.shape[-1]:
            x = jnp.where(jnp.arange(x.shape[-1]) < self.vocab_size, x, -jnp.inf)
        if self.greedy:
            return x
        x = x / self.temperature
        if 0 < self.top_k < x.shape[-1]:
            x = jnp.where(top_k_mask(x, self.top_k), x, -jnp.inf)
        if self.top_p < 1:
            x = jnp.where(top_p_mask(x, self.top_p), x, -jnp.inf)
        return x

    def __call__(self, logits_BV: Array, key: Array) -> Array:
        """Token ids [B] int32; ``key`` is ignored when greedy.

        Args:
            logits_BV: Logits [B, V].
            key: The random key.

        Returns:
            The chosen ids [B] int32.
        """
        x = self.filtered_logits(logits_BV)
        if self.greedy:
            return jnp.argmax(x, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


GREEDY = Sampler(temperature=0.0)
