"""PyTorch's fused ``scaled_dot_product_attention`` on the bench's inputs: the reference the dense
XLA path is held to (issue 14: within 2x on CPU). Optional: the row is left out without torch."""

from __future__ import annotations

import statistics
import time

import numpy as np

from fibjax.bench.timing import Measurement


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def measure(q, k, v, repeats: int) -> dict[str, Measurement]:
    """{"fwd", "fwd+bwd"}: causal SDPA on the same [B,T,H,D] / [B,T,K,D] arrays (GQA by
    ``enable_gqa``), in torch's own threads; peak memory is not measured (nan)."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(q.dtype)]
    q_t, k_t, v_t = (torch.from_numpy(np.asarray(x, np.float32)).to(dtype).transpose(1, 2).contiguous() for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def forward():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, enable_gqa=gqa)

    def forward_backward():
        leaves = [x.detach().requires_grad_() for x in (q_t, k_t, v_t)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)
        out.float().sum().backward()

    results = {}
    for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        fn()  # warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        results[mode] = Measurement(statistics.median(times), max(times) - min(times), float("nan"))
    return results
