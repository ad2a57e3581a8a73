"""The decoder's layer modes: the model's own blocks run with these in place of their attention
(``fibjax.layer_modes`` says what a mode is), so prefill is the model's own forward and a step is
its forward over one token. Each layer's kind does the work (``AttentionKind.prompt`` / ``step``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from fibjax.kinds.base import LayerPlan

Array = jax.Array


class PromptMode(NamedTuple):
    """The prompt: each layer attends as a full forward at the capacity and records its cache
    (``sow`` "cache")."""

    plans: tuple[LayerPlan, ...]

    def __call__(self, attn, q_BPHE: Array, k_BPKE: Array, v_BPKE: Array, x_BPD: Array) -> Array:
        plan = self.plans[attn.layer]
        out_BPHE, cache = plan.kind.prompt(plan, attn, q_BPHE, k_BPKE, v_BPKE, x_BPD)
        attn.sow(nnx.Intermediate, "cache", cache)
        return out_BPHE


class TokenMode(NamedTuple):
    """One decoding step at ``pos``: each layer reads its ``cache`` entry (as it was before this
    position) and records the entry with this position written (``sow`` "cache")."""

    plans: tuple[LayerPlan, ...]
    cache: tuple
    pos: Array

    def __call__(self, attn, q_B1HE: Array, k_B1KE: Array, v_B1KE: Array, x_B1D: Array) -> Array:
        plan = self.plans[attn.layer]
        out_B1HE, written = plan.kind.step(plan, attn, q_B1HE, k_B1KE, v_B1KE, x_B1D, self.cache[attn.layer], self.pos)
        attn.sow(nnx.Intermediate, "cache", written)
        return out_B1HE
