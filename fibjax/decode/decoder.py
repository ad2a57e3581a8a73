"""Incremental decoding of a ``fibjax.model.Transformer``: prefill a prompt, then one token a step.

The decoder runs the model's own blocks (``Transformer.hidden``) with a layer mode in place of
attention (``attend.PromptMode``, ``attend.TokenMode``): the prompt through the library's paths,
each new token against the per-layer cache (``cache.py`` plans it; each layer's kind, ``fibjax.kinds``, says how
it is read). RoPE positions
are absolute. The capacity ``max_len`` fixes every cache shape, and the position is a traced
argument, so the step compiles once per (capacity, batch, sampler) and never per token
(``traces`` counts the traces). Rows of a batch share one length (no padding).

>>> decoder = Decoder(model, max_len=1024)
>>> for tokens_B in decoder.generate(prompt_BP, 100, sampler=Sampler(temperature=0.8, top_p=0.95), seed=0):
...     print(tokens_B)
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from fibjax.decode import cache as cache_lib
from fibjax.decode.modes import PromptMode, TokenMode
from fibjax.decode.sampling import GREEDY, Sampler

Array = jax.Array


class Decoder:
    """Cached generation for one model (its parameters as they are now) up to ``max_len`` tokens.

    Args:
        model: The model (a [Transformer][fibjax.model.Transformer]).
        max_len: The capacity in tokens, prompt included (>= 2).
    """

    def __init__(self, model: nnx.Module, max_len: int):
        self.cfg = model.cfg
        self.max_len = max_len
        self.plans = cache_lib.plan_layers(model, max_len)
        self.graphdef, self.state = nnx.split(model)
        self.traces: collections.Counter[str] = collections.Counter()
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("sampler",))
        self._step = jax.jit(self._step_fn, static_argnames=("sampler",), donate_argnums=(1,))

    # --- the jitted programs ----------------------------------------------------------------

    def _prefill_fn(self, state, tokens_BP: Array, key: Array, sampler: Sampler):
        self.traces["prefill"] += 1
        b, p = tokens_BP.shape
        positions_BP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        x_BPD, cache = self._blocks(state, tokens_BP, positions_BP, PromptMode(self.plans))
        logits_BV = nnx.merge(self.graphdef, state).logits(x_BPD[:, -1:])[:, 0]
        return cache, logits_BV, sampler(logits_BV, jax.random.fold_in(key, p))

    def _step_fn(self, state, cache: cache_lib.Cache, tokens_B: Array, pos: Array, key: Array, sampler: Sampler):
        self.traces["step"] += 1
        positions_B1 = jnp.full((tokens_B.shape[0], 1), pos, jnp.int32)
        x_B1D, new_cache = self._blocks(state, tokens_B[:, None], positions_B1, TokenMode(self.plans, cache, pos))
        logits_BV = nnx.merge(self.graphdef, state).logits(x_B1D)[:, 0]
        return new_cache, logits_BV, sampler(logits_BV, jax.random.fold_in(key, pos + 1))

    def _blocks(self, state, tokens_BT: Array, positions_BT: Array, mode) -> tuple[Array, cache_lib.Cache]:
        """The model's own blocks (``Transformer.hidden``) with ``mode`` in place of attention:
        the residual stream and every layer's cache entry, as the mode recorded it."""
        model = nnx.merge(self.graphdef, state)
        x_BTD, sown = nnx.capture(lambda m: m.hidden(tokens_BT, positions_BT, mode=mode), nnx.Intermediate)(model)
        return x_BTD, tuple(sown["blocks"][i]["attn"]["cache"][0] for i in range(len(self.plans)))

    # --- the public calls -----------------------------------------------------------------

    def prefill(self, tokens_BP: ArrayLike, *, sampler: Sampler = GREEDY, key: Array | None = None) -> tuple[cache_lib.Cache, Array, Array]:
        """Run the prompt [B, P]: (cache, logits [B, V] at position P-1, the token chosen for position P).

        Args:
            tokens_BP: The prompt's token ids [B, P].
            sampler: How to choose the next token.
            key: The random key for sampling (default key 0).

        Returns:
            (cache, logits [B, V], next token [B]).

        Raises:
            ValueError: A prompt that is not [B, P >= 1] or longer than ``max_len``.
        """
        tokens_BP = jnp.asarray(tokens_BP, jnp.int32)
        if tokens_BP.ndim != 2 or tokens_BP.shape[1] < 1:
            raise ValueError(f"the prompt must be [batch, length >= 1] token ids, got shape {tokens_BP.shape}")
        if tokens_BP.shape[1] > self.max_len:
            raise ValueError(f"the prompt has {tokens_BP.shape[1]} tokens, more than this decoder's max_len {self.max_len}")
        return self._prefill(self.state, tokens_BP, _key(key), sampler=sampler)

    def step(
        self, cache: cache_lib.Cache, tokens_B: ArrayLike, pos: int, *, sampler: Sampler = GREEDY, key: Array | None = None
    ) -> tuple[cache_lib.Cache, Array, Array]:
        """Feed the token at position ``pos``: (cache, logits [B, V] at pos, the token chosen for pos + 1).

        ``cache`` is donated: use the returned one. Positions past ``max_len - 1`` are refused.

        Args:
            cache: The cache before ``pos`` (donated).
            tokens_B: The tokens at ``pos`` [B].
            pos: Their position.
            sampler: How to choose the next token.
            key: The random key for sampling (default key 0).

        Returns:
            (cache, logits [B, V], next token [B]).

        Raises:
            ValueError: ``pos`` outside [0, max_len).
        """
        if not 0 <= pos < self.max_len:
            raise ValueError(f"position {pos} is outside this decoder's capacity [0, {self.max_len})")
        return self._step(self.state, cache, jnp.asarray(tokens_B, jnp.int32), jnp.int32(pos), _key(key), sampler=sampler)

    def generate(
        self, prompt_BP: ArrayLike, max_new_tokens: int, *, sampler: Sampler = GREEDY, seed: int = 0, stop_token: int | None = None
    ) -> Iterator[np.ndarray]:
        """Yield the new tokens [B] one position at a time, stopping early once every row has
        produced ``stop_token`` (which is yielded). The draw for position n uses
        fold_in(key(seed), n), so a sequence does not depend on how it was produced.

        Args:
            prompt_BP: The prompt's token ids [B, P].
            max_new_tokens: The most tokens to generate (>= 1).
            sampler: How to choose each token.
            seed: The sampling seed.
            stop_token: Stop once every row has produced it (None: never).

        Yields:
            The new tokens [B], one position at a time.

        Raises:
            ValueError: ``max_new_tokens < 1`` or a prompt plus new tokens longer than ``max_len``.
        """
        prompt_BP = np.asarray(prompt_BP)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt_BP.ndim == 2 and prompt_BP.shape[1] + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt_BP.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds this decoder's max_len {self.max_len}")
        key = jax.random.key(seed)
        cache, _, next_B = self.prefill(prompt_BP, sampler=sampler, key=key)
        pos, stopped = prompt_BP.shape[1], np.zeros(prompt_BP.shape[0], bool)
        for i in range(max_new_tokens):
            # dispatch the next step before reading this token, so the host never waits idle
            ahead = self.step(cache, next_B, pos, sampler=sampler, key=key) if i + 1 < max_new_tokens else None
            tokens_B = np.asarray(next_B)
            yield tokens_B
            if stop_token is not None:
                stopped |= tokens_B == stop_token
            if ahead is None or stopped.all():
                return
            cache, _, next_B = ahead
            pos += 1

    def init_cache(self, batch: int = 1) -> cache_lib.Cache:
        """An empty cache (e.g. to time steps at a given position without a prompt).

        Args:
            batch: The batch size.

        Returns:
            The cache.
        """
        return cache_lib.init_cache(self.plans, batch, self.cfg.num_kv_heads, self.cfg.resolved_head_dim, self.cfg.dtype)


def _key(key: Array | None) -> Array:
    return jax.random.key(0) if key is None else key
