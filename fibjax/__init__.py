"""fibjax: sparse-attention language models in JAX/Flax (Fibonacci offsets and SSA).

The public surface (what semantic versioning covers, CHANGELOG.md): the packages and modules
listed in ``__all__`` below and, within each package, the names of its own ``__all__``
(docs/reference/api.md is generated from them; tests/test_public_api.py keeps a record of 0.1's).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "attention", "config", "data", "decode", "eval", "hf", "kinds", "model", "run", "train"]
