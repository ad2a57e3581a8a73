"""``python -m launch.bench formulations``: the XLA formulations we chose between, side by side.

The static path (fibonacci, W=12, the middle layer's staggered alpha) three ways:
``gather``   an index gather of K/V into [B, T, S, K, D] and one einsum per side;
``slots``    every distance a shifted view of K/V (no band);
``band``     the window as a blocked band + shifted views for the rungs (what fibjax ships).

Dense causal attention two ways (queries in chunks of 256, each reading the keys before its end):
``dense_autodiff``  each chunk under ``jax.checkpoint``, its backward by autodiff through the
                    softmax (what fibjax shipped before the custom backward);
``dense_flash``     ``dense_attention_xla``: a custom backward from the saved log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fibjax import attention
from fibjax.attention import offset_xla
from fibjax.attention.common import finish, group_queries, masked_softmax, stats_dtype
from fibjax.attention.dense import dense_attention_xla
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


def dense_autodiff_attention(q, k, v, chunk: int = 256):
    t = q.shape[1]
    q_BTKGD = group_queries(q, k.shape[2])

    def attend(q_BCKGD, start: int, stop: int):
        s_BKGCT = jnp.einsum("bckgd,btkd->bkgct", q_BCKGD, k[:, :stop], preferred_element_type=stats_dtype(k))
        causal_CT = (start + np.arange(stop - start))[:, None] >= np.arange(stop)[None, :]
        p_BKGCT, lse_BKGC = masked_softmax(s_BKGCT, causal_CT)
        return jnp.einsum("bkgct,btkd->bckgd", p_BKGCT, v[:, :stop].astype(p_BKGCT.dtype)), jnp.transpose(lse_BKGC, (0, 3, 1, 2))

    outs = [jax.checkpoint(attend, static_argnums=(1, 2))(q_BTKGD[:, s : s + chunk], s, min(s + chunk, t)) for s in range(0, t, chunk)]
    o_BTKGD, lse_BTKG = (jnp.concatenate(x, axis=1) for x in zip(*outs))
    return finish(o_BTKGD, lse_BTKG, q, False)


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
            "dense_autodiff": lambda q, k, v, alpha: dense_autodiff_attention(q, k, v),
            "dense_flash": lambda q, k, v, alpha: dense_attention_xla(q, k, v),
        }
        alpha = jnp.float32(case.alpha)  # unused by the static path; the bench's common signature
        for name, f in fns.items():
            fwd, fb = measure(f, q, k, v, alpha, repeats=repeats), measure(forward_backward(f), q, k, v, alpha, repeats=repeats)
            lines.append(f"| {t} | {name} | {fwd.ms:.1f} | {fb.ms:.1f} | {fb.peak_mb:.0f} |")
    return "\n".join(lines)
