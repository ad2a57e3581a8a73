"""fibjax: sparse-attention language models in JAX/Flax (Fibonacci offsets and SSA)."""

__version__ = "0.1.0"
