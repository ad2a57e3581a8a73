"""Sliding-window and attention-sink attention: query i attends the keys j with 0 <= i - j < W
(the last W keys, itself included: Mistral's ``sliding_window``), and with sinks also the first
S positions (StreamingLLM), the union counted once.

On XLA the queries go in chunks of C; a chunk reads only its band of C + W - 1 keys (gathered
once per chunk) and the S sink keys, so scores are [T, C + W - 1 + S], O(T * W) memory, never a
masked [T, T]. The gradient is JAX's own through the same arithmetic (its residuals are the
same O(T * W) scores). On GPU, ``window_attention`` takes cuDNN's sliding-window flash
attention where cuDNN takes the call (``fused.fits_cudnn``: bf16/fp16, head dim <= 128, and a
GPU backend; the XLA path otherwise and for the log-sum-exp, as dense attention does).

The sink columns may be scored with queries of their own (``q_sinks``): the sinks kind passes
its queries rotated back to their StreamingLLM cache position (``fibjax.kinds.window``).
Letters: N query chunks, C queries per chunk, U band keys per chunk (C + W - 1), S sinks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fibjax.attention.common import Array, check_qkv, finish, group_queries, masked_softmax, stats_dtype
from fibjax.attention.fused import fits_cudnn
from fibjax.attention.pallas.backend import IMPLEMENTATIONS

MIN_CHUNK = 32  # queries per chunk: max(W, this), so a chunk's band is at most about twice its keys


def _band(q_BTHE, k_BTKE, v_BTKE, q_sinks_BTHE, window: int, sinks: int, chunk: int):
    """Output [B,T,K,G,E] float32 and lse [B,T,K,G] of the union of the band {0..W-1} and the
    first ``sinks`` positions (both already at most T)."""
    b, t, kh, e = k_BTKE.shape
    g, n = q_BTHE.shape[2] // kh, -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t), (0, 0), (0, 0), (0, 0))
    q_BNCKGE = jnp.pad(group_queries(q_BTHE, kh), pad).reshape(b, n, chunk, kh, g, e)
    i_NC = np.arange(n * chunk).reshape(n, chunk)  # query positions (past T: padding, dropped)
    j_NU = i_NC[:, :1] - (window - 1) + np.arange(chunk + window - 1)  # a chunk's band of keys
    rows_NU = np.clip(j_NU, 0, t - 1)
    k_BNUKE, v_BNUKE = (jnp.take(x, rows_NU, axis=1) for x in (k_BTKE, v_BTKE))
    d_NCU = i_NC[:, :, None] - j_NU[:, None, :]
    valid = [(d_NCU >= 0) & (d_NCU < window) & (j_NU[:, None, :] >= 0) & (j_NU[:, None, :] < t)]
    f32 = stats_dtype(q_BTHE)
    s_BKGNCU = [jnp.einsum("bnckge,bnuke->bkgncu", q_BNCKGE, k_BNUKE, preferred_element_type=f32)]
    if sinks:
        qs_BNCKGE = jnp.pad(group_queries(q_sinks_BTHE, kh), pad).reshape(b, n, chunk, kh, g, e)
        d_NCS = i_NC[:, :, None] - np.arange(sinks)
        valid.append(d_NCS >= window)  # earlier than the band (the band's own keys count once)
        s_BKGNCU.append(jnp.einsum("bnckge,bske->bkgncs", qs_BNCKGE, k_BTKE[:, :sinks], preferred_element_type=f32))
    p_BKGNCU, lse_BKGNC = masked_softmax(jnp.concatenate(s_BKGNCU, -1), jnp.concatenate(valid, -1))
    u = chunk + window - 1
    o_BKGNCE = jnp.einsum("bkgncu,bnuke->bkgnce", p_BKGNCU[..., :u], v_BNUKE.astype(f32))
    if sinks:
        o_BKGNCE += jnp.einsum("bkgncs,bske->bkgnce", p_BKGNCU[..., u:], v_BTKE[:, :sinks].astype(f32))
    as_BTKG_ = lambda x: jnp.moveaxis(x.reshape(b, kh, g, n * chunk, *x.shape[5:]), 3, 1)  # noqa: E731
    return as_BTKG_(o_BKGNCE), as_BTKG_(lse_BKGNC)


@functools.partial(jax.jit, static_argnames=("window", "sinks", "return_lse", "query_chunk"))
def band_attention_xla(q, k, v, q_sinks=None, *, window: int, sinks: int = 0, return_lse: bool = False, query_chunk: int | None = None):
    """The XLA path of both functions below: [B,T,H,E] (and lse [B,T,H] float32)."""
    t = q.shape[1]
    w, s = min(window, t), min(sinks, t)
    chunk = min(query_chunk or max(w, MIN_CHUNK), t)
    o_BTKGE, lse_BTKG = _band(q, k, v, q if q_sinks is None else q_sinks, w, s, chunk)
    return finish(o_BTKGE, lse_BTKG, q, return_lse)


def _cudnn_backend() -> bool:
    """A GPU backend, so that cuDNN can be traced (tracing its call raises where none is found)."""
    return jax.default_backend() == "gpu"


def cudnn_window(q: Array, k: Array, v: Array, window: int) -> Array:
    """cuDNN's causal sliding window: ``local_window_size=(W - 1, 0)`` keeps 0 <= i - j <= W - 1."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation="cudnn")


def _check(q, k, v, window, sinks, implementation):
    check_qkv(q, k, v)
    for name, value, low in (("window", window, 1), ("sinks", sinks, 0)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def window_attention(  # noqa: DOC502
    q: Array, k: Array, v: Array, *, window: int, return_lse: bool = False, implementation: str | None = None, query_chunk: int | None = None
) -> Array | tuple[Array, Array]:
    """Sliding-window attention: query i attends keys j with 0 <= i - j < ``window`` (the last W
    keys, itself included; W >= T is dense causal attention).

    ``implementation``: None (or "pallas") takes cuDNN's sliding-window flash attention on a GPU
    where cuDNN takes the call (bf16/fp16, head dim a multiple of 8 up to 128), else the XLA
    path; "xla" the XLA path; ``return_lse`` always the XLA path. ``query_chunk``: the XLA path's
    queries per chunk (default max(W, 32)).

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        window: W >= 1, the keys per query.
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        implementation: None, ``"pallas"`` or ``"xla"``.
        query_chunk: The XLA path's queries per chunk.

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: A bad ``window``, an unknown ``implementation`` or shapes that disagree.
    """
    _check(q, k, v, window, 0, implementation)
    window = int(window)
    xla = functools.partial(band_attention_xla, window=window, return_lse=return_lse, query_chunk=query_chunk)
    if return_lse or implementation == "xla" or not (fits_cudnn(q) and _cudnn_backend()):
        return xla(q, k, v)
    try:
        return jax.lax.platform_dependent(q, k, v, default=xla, cuda=lambda q, k, v: cudnn_window(q, k, v, min(window, q.shape[1])))
    except (RuntimeError, ValueError, NotImplementedError):  # cuDNN refused the call (its version, the shape): XLA
        return xla(q, k, v)


def sinks_attention(  # noqa: DOC503
    q: Array, k: Array, v: Array, *, sinks: int, window: int, q_sinks: Array | None = None, return_lse: bool = False, query_chunk: int | None = None
) -> Array | tuple[Array, Array]:
    """Attention sinks plus a sliding window (StreamingLLM): query i attends the first ``sinks``
    positions j < S (j <= i) and the keys with 0 <= i - j < ``window``, each key once. The sink
    columns are scored with ``q_sinks`` where given (same shape as q; default q). XLA only.

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        sinks: S, the sink positions.
        window: W, the window's keys per query.
        q_sinks: Queries for the sink columns (default q).
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        query_chunk: The XLA path's queries per chunk.

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: ``q_sinks`` not of q's shape, bad ``sinks`` or ``window``, or shapes that disagree.
    """
    _check(q, k, v, window, sinks, None)
    if q_sinks is not None and q_sinks.shape != q.shape:
        raise ValueError(f"q_sinks must have q's shape {q.shape}, got {q_sinks.shape}")
    return band_attention_xla(q, k, v, q_sinks, window=int(window), sinks=int(sinks), return_lse=return_lse, query_chunk=query_chunk)
