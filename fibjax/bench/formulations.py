"""``python -m launch.bench formulations``: the XLA formulations we chose between, side by side.

The static path (fibonacci, W=12, the middle layer's staggered alpha) three ways:
``gather``   an index gather of K/V into [B, T, S, K, D] and one einsum per side;
``slots``    every distance a shifted view of K/V (no band);
``band``     the window as a blocked band + shifted views for the rungs (what fibjax ships).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fibjax import attention
from fibjax.attention import offset_xla
from fibjax.attention.common import finish, group_queries, masked_softmax
from fibjax.bench.attention import Case, forward_backward, inputs
from fibjax.bench.timing import measure


def gather_attention(q, k, v, distances):
    t = q.shape[1]
    idx_TS = np.maximum(np.arange(t)[:, None] - np.asarray(distances)[None, :], 0)
    q_BTKGD = group_queries(q, k.shape[2])
    s_BTKGS = jnp.einsum("btkgd,btskd->btkgs", q_BTKGD, k[:, idx_TS], preferred_element_type=jnp.float32)
    valid_TS = np.arange(t)[:, None] >= np.asarray(distances)[None, :]
    p_BTKGS, lse_BTKG = masked_softmax(s_BTKGS, jnp.asarray(valid_TS)[None, :, None, None, :])
    return finish(jnp.einsum("btkgs,btskd->btkgd", p_BTKGS, v[:, idx_TS].astype(jnp.float32)), lse_BTKG, q, False)


def slots_attention(q, k, v, distances):
    return offset_xla._sparse_attention(q, k, v, window=None, distances=distances, rungs=None, seq_len=q.shape[1], return_lse=False)


def run(seq_lens: list[int], repeats: int) -> str:
    lines = ["| seq | formulation | fwd ms | fwd+bwd ms | fwd+bwd peak MB |", "|---:|---|---:|---:|---:|"]
    for t in seq_lens:
        case = Case(seq_len=t)
        q, k, v = inputs(case)
        ds = attention.attended_distances(window=case.window, base="fibonacci", alpha=case.alpha, seq_len=t)
        fns = {
            "gather": lambda q, k, v, alpha: gather_attention(q, k, v, ds),
            "slots": lambda q, k, v, alpha: slots_attention(q, k, v, ds),
            "band": lambda q, k, v, alpha: attention.offset_attention(q, k, v, distances=ds),
        }
        alpha = jnp.float32(case.alpha)  # unused by the static path; the bench's common signature
        for name, f in fns.items():
            fwd, fb = measure(f, q, k, v, alpha, repeats=repeats), measure(forward_backward(f), q, k, v, alpha, repeats=repeats)
            lines.append(f"| {t} | {name} | {fwd.ms:.1f} | {fb.ms:.1f} | {fb.peak_mb:.0f} |")
    return "\n".join(lines)
