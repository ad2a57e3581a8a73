"""PyTorch's fused ``scaled_dot_product_attention`` on the bench's inputs: the reference the dense
XLA path is held to (issue 14: within 2x on CPU). Optional: the row is left out without torch."""

from __future__ import annotations

import time

import numpy as np

from fibjax.bench.timing import Measurement, of_rounds


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


class _Timer:
    """One torch call timed like ``timing.Timer`` (warmed up once; ``times`` runs it ``repeats``
    times), so it joins the JAX paths' rounds; peak memory is not measured (nan)."""

    def __init__(self, fn):
        self._fn = fn
        fn()  # warm up
        self.peak_mb = float("nan")

    def times(self, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            self._fn()
            out.append((time.perf_counter() - start) * 1e3)
        return out

    def measurement(self, rounds_ms: list[list[float]]) -> Measurement:
        return of_rounds(rounds_ms, self.peak_mb)


def timers(q, k, v) -> dict[str, _Timer]:
    """{"fwd", "fwd+bwd"}: causal SDPA on the same [B,T,H,D] / [B,T,K,D] arrays (GQA by
    ``enable_gqa``), in torch's own threads."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(q.dtype)]
    q_t, k_t, v_t = (torch.from_numpy(np.array(x, np.float32)).to(dtype).transpose(1, 2).contiguous() for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def forward():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, enable_gqa=gqa)

    def forward_backward():
        leaves = [x.detach().requires_grad_() for x in (q_t, k_t, v_t)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)
        out.float().sum().backward()

    return {"fwd": _Timer(forward), "fwd+bwd": _Timer(forward_backward)}
