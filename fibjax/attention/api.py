"""The public attention functions: argument checks, then the implementation.

Layout: q [batch, seq, q_heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] with
q_heads % kv_heads == 0. RoPE is applied by the caller; the scale is 1/sqrt(head_dim); every
path is causal; the output has q's shape and dtype; softmax statistics are float32. With
``return_lse=True`` a path returns ``(out, lse)``, lse [batch, seq, q_heads] float32, the
log-sum-exp of the scaled scores over the keys the query attended (-inf if none).

The offset and block-sparse paths take ``implementation``: ``"xla"`` (``offset_xla.py``,
``block_sparse.py``), ``"pallas"`` (``pallas/``: fused kernels; interpret mode on CPU, slow) or
None, which picks XLA until the kernels have passed their hardware check on a platform
(``pallas.backend.PALLAS_BY_DEFAULT``).
Under a device mesh the kernels run per shard (``sharded.py``). Dense attention takes the
platform's fused kernel by default (``fused.py``: cuDNN on GPU, JAX's Pallas flash on TPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from fibjax.attention import offsets
from fibjax.attention.alpha import ALPHA_MAX, ALPHA_MIN
from fibjax.attention.block_sparse import block_sparse_attention_xla, check_budget
from fibjax.attention.common import check_qkv
from fibjax.attention.dense import dense_attention_xla
from fibjax.attention.fused import dense_attention_fused
from fibjax.attention.offset_xla import frozen_interpolated_attention_xla, interpolated_attention_xla, offset_attention_xla
from fibjax.attention.pallas import backend as pallas_backend
from fibjax.attention.pallas import interpolated_attention_pallas, offset_attention_pallas
from fibjax.attention.pallas.backend import IMPLEMENTATIONS
from fibjax.attention.pallas.block_ops import block_sparse_attention_pallas
from fibjax.attention.sharded import per_shard

Array = jax.Array


def dense_attention(q: Array, k: Array, v: Array, *, return_lse: bool = False, implementation: str | None = None) -> Array | tuple[Array, Array]:  # noqa: DOC503
    """Plain causal attention: query i attends every key j <= i.

    ``implementation``: None (or "pallas") takes the platform's fused kernel where its shape
    rules hold (cuDNN flash attention on GPU for bf16/fp16, JAX's Pallas flash attention on TPU;
    ``fibjax.attention.fused``), "xla" the XLA path; CPU and ``return_lse`` always the XLA path.

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        implementation: None, ``"pallas"`` or ``"xla"``.

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: An unknown ``implementation`` or shapes that disagree.
    """
    check_qkv(q, k, v)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if return_lse or implementation == "xla":
        return dense_attention_xla(q, k, v, return_lse=return_lse)
    return dense_attention_fused(q, k, v)


def offset_attention(  # noqa: DOC502
    q: Array, k: Array, v: Array, *, distances: Sequence[int], return_lse: bool = False, implementation: str | None = None
) -> Array | tuple[Array, Array]:
    """Static offset attention: query i attends keys i - d for d in ``distances`` (i >= d).

    ``distances`` are Python ints known at trace time, usually from
    [attended_distances][fibjax.attention.attended_distances].

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        distances: The attended distances (ints >= 0; sorted and deduplicated here).
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        implementation: None, ``"pallas"`` or ``"xla"`` (module docstring).

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: Empty or negative ``distances``, an unknown ``implementation`` or shapes that
            disagree.
    """
    check_qkv(q, k, v)
    distances = _check_distances(distances)
    if pallas_backend.use_pallas(implementation):
        kernel = lambda q, k, v: offset_attention_pallas(q, k, v, distances=distances, return_lse=return_lse)  # noqa: E731
        return per_shard(kernel, q, k, v, return_lse=return_lse)
    return offset_attention_xla(q, k, v, distances=distances, return_lse=return_lse)


def interpolated_attention(
    q: Array, k: Array, v: Array, *, window: int, base: offsets.Base, alpha: float | Array, return_lse: bool = False, implementation: str | None = None
) -> Array | tuple[Array, Array]:
    """Learned-alpha attention: window {0..W} plus interpolated rungs at alpha * f.

    ``alpha`` may be a traced scalar (it is differentiable, and changing it never recompiles:
    the rung slots are fixed and masked). It must lie in [0.5, 1.5], the range a learned layer
    reaches by construction (0.5 + sigmoid(logit)); a concrete value outside raises. A Python
    float is a *frozen* alpha (inference after training): on the XLA path the same rungs and
    weights are compiled as constants with static shifts, as cheap as the static path; each new
    float compiles again, so pass an array to vary it.

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        window: W, the dense window {0..W}.
        base: The rungs: ``"fibonacci"``, ``"pow2"`` or a sequence of ints.
        alpha: The rung scale: a (traced) scalar array, or a Python float for a frozen alpha.
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        implementation: None, ``"pallas"`` or ``"xla"`` (module docstring).

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: ``window`` not an int >= 0, a concrete ``alpha`` outside [0.5, 1.5], an unknown
            ``implementation`` or shapes that disagree.
    """
    check_qkv(q, k, v)
    if not _is_int(window) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    window = int(window)
    offsets.base_rungs(base, q.shape[1])  # validates base
    base = base if isinstance(base, str) else tuple(base)
    if not isinstance(alpha, jax.core.Tracer):
        a = float(alpha)
        if not ALPHA_MIN <= a <= ALPHA_MAX:
            raise ValueError(f"alpha must lie in [0.5, 1.5], got {a}")
    if pallas_backend.use_pallas(implementation):
        kernel = lambda q, k, v, a: interpolated_attention_pallas(q, k, v, window=window, base=base, alpha=a, return_lse=return_lse)  # noqa: E731
        return per_shard(kernel, q, k, v, jax.numpy.asarray(alpha, jax.numpy.float32), return_lse=return_lse)
    if isinstance(alpha, float | int) and not isinstance(alpha, bool):
        return frozen_interpolated_attention_xla(q, k, v, window=window, base=base, alpha=float(alpha), return_lse=return_lse)
    return interpolated_attention_xla(q, k, v, window=window, base=base, alpha=alpha, return_lse=return_lse)


def block_sparse_attention(  # noqa: DOC502
    q: Array, k: Array, v: Array, *, block_size: int, num_blocks: int, block_rank: str = "mean_key", return_lse: bool = False, implementation: str | None = None
) -> Array | tuple[Array, Array]:
    """Causal block-sparse attention: each query attends its own block (up to itself) and the
    ``num_blocks - 1`` earlier blocks of ``block_size`` keys that rank highest by ``block_rank``
    (``fibjax.attention.block_sparse``: the group-summed q . mean key, or NSA's group-summed
    per-head softmax probability; ties to the lower block).

    q [B,T,H,D], k/v [B,T,K,D] with RoPE applied; scale 1/sqrt(D); output in q's dtype, and
    lse [B,T,H] float32 with ``return_lse=True``. ``num_blocks >= ceil(T / block_size)`` is
    dense causal attention. ``implementation="pallas"``: the block-sparse kernels
    (``pallas/block_ops.py``; the same choice of blocks, the same function).

    Args:
        q: Queries [B,T,H,D], RoPE applied.
        k: Keys [B,T,K,D] (H a multiple of K).
        v: Values [B,T,K,D].
        block_size: Keys per block.
        num_blocks: Blocks each query attends, its own included.
        block_rank: ``"mean_key"`` or NSA's per-head probability ranking
            (``fibjax.attention.block_sparse.BLOCK_RANKS``).
        return_lse: Also return the log-sum-exp [B,T,H] float32.
        implementation: None, ``"pallas"`` or ``"xla"``.

    Returns:
        The output [B,T,H,D] in q's dtype; with ``return_lse``, the pair (output, lse).

    Raises:
        ValueError: ``block_size`` or ``num_blocks`` not an int >= 1, an unknown ``block_rank`` or
            ``implementation``, or shapes that disagree.
    """
    check_qkv(q, k, v)
    check_budget(block_size, num_blocks, block_rank)
    budget = dict(block_size=int(block_size), num_blocks=int(num_blocks), block_rank=block_rank, return_lse=return_lse)
    if pallas_backend.use_pallas(implementation):
        kernel = lambda q, k, v: block_sparse_attention_pallas(q, k, v, **budget)  # noqa: E731
        return per_shard(kernel, q, k, v, return_lse=return_lse, whole_groups=True)
    return block_sparse_attention_xla(q, k, v, **budget)


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_distances(distances: Sequence[int]) -> tuple[int, ...]:
    ds = tuple(distances)
    if not ds or not all(_is_int(d) and d >= 0 for d in ds):
        raise ValueError(f"distances must be a non-empty sequence of ints >= 0, got {distances!r}")
    return tuple(sorted({int(d) for d in ds}))
