"""PyTorch's fused ``scaled_dot_product_attention`` on the bench's inputs: the reference the dense
XLA path is held to (the aim: within 2x on CPU). Optional: the row is left out without torch."""

from __future__ import annotations

import numpy as np

from fibjax.bench.timing import CallTimer


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def timers(q, k, v) -> dict[str, CallTimer]:
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

    return {"fwd": CallTimer(forward), "fwd+bwd": CallTimer(forward_backward)}
